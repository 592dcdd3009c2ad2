"""The one registry of ggml types: for each type expertpack writes or decodes, its block (values per
block, and bytes as the sum of its parts in the order of ggml-common.h's struct) and whether the
worker decodes it. packtools sizes tensors with it, synth fills blocks through it, and the worker's
decoders (torch in weights/quant.py and weights/quant_iq.py, Triton in kernels/dequant_tl.py) are
keyed by it.

Contract: a registered type's sizes equal gguf-py's GGML_QUANT_SIZES (a test checks); a type not
registered (NVFP4, the legacy Q8_1/Q8_K, ...) is sized by gguf-py's table, copied as bytes by
packtools and refused by the worker at load. Needs gguf only: packtools never imports torch or the worker."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK = 32  # values in a block of the legacy quants (Q4_0 .. Q8_0) and of MXFP4
QK_K = 256  # values in a K-quant superblock
K_SCALE_SIZE = 12  # Q3_K's 16 six-bit scales; Q4_K's and Q5_K's 8 six-bit scales and 8 mins
QK4_NL = 32  # values in an IQ4_NL block


@dataclass(frozen=True)
class Part:
    """One field of a block struct: `qs`, `d`, `scales`, ..., as ggml-common.h names it."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Quant:
    """One ggml type: `values` values stored in a block of `parts`, laid out in order."""

    ggml_type: T
    values: int
    parts: tuple[Part, ...]
    decoded: bool = True  # the worker decodes it to floats (in torch and in the Triton kernels); False: read as integers

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def part_bytes(self) -> tuple[int, ...]:
        """The parts' sizes in order: where to split a [n_blocks, nbytes] array into its fields."""
        return tuple(p.nbytes for p in self.parts)

    def offset(self, name: str) -> int:
        """Byte offset of part `name` in the block."""
        at = 0
        for p in self.parts:
            if p.name == name:
                return at
            at += p.nbytes
        raise KeyError(f"{self.ggml_type.name} has no part {name!r}; its parts are "
                       f"{', '.join(p.name for p in self.parts)}")


def _quant(ggml_type: T, values: int, *, decoded: bool = True, **parts: int) -> Quant:
    return Quant(ggml_type, values, tuple(Part(name, n) for name, n in parts.items()), decoded)


# ggml-common.h's block structs, field by field.
QUANTS: dict[T, Quant] = {q.ggml_type: q for q in (
    _quant(T.F32, 1, value=4),
    _quant(T.F16, 1, value=2),
    _quant(T.BF16, 1, value=2),
    _quant(T.Q4_0, QK, d=2, qs=QK // 2),
    _quant(T.Q4_1, QK, d=2, m=2, qs=QK // 2),
    _quant(T.Q5_0, QK, d=2, qh=QK // 8, qs=QK // 2),
    _quant(T.Q5_1, QK, d=2, m=2, qh=QK // 8, qs=QK // 2),
    _quant(T.Q8_0, QK, d=2, qs=QK),
    _quant(T.Q2_K, QK_K, scales=QK_K // 16, qs=QK_K // 4, d=2, dmin=2),
    _quant(T.Q3_K, QK_K, hmask=QK_K // 8, qs=QK_K // 4, scales=K_SCALE_SIZE, d=2),
    _quant(T.Q4_K, QK_K, d=2, dmin=2, scales=K_SCALE_SIZE, qs=QK_K // 2),
    _quant(T.Q5_K, QK_K, d=2, dmin=2, scales=K_SCALE_SIZE, qh=QK_K // 8, qs=QK_K // 2),
    _quant(T.Q6_K, QK_K, ql=QK_K // 2, qh=QK_K // 4, scales=QK_K // 16, d=2),
    _quant(T.MXFP4, QK, e=1, qs=QK // 2),  # e: an E8M0 exponent shared by the block
    # The i-quants and ternary quants (their Triton decoders read the grids through a table
    # pointer: weights.quant_iq.kernel_tables). Where ggml's struct packs two
    # fields in one array, they are two parts here, named as ggml's decoders name them: IQ2_S's
    # qs[QK_K/4] is grid indices, then signs; IQ3_XXS's qs[3*QK_K/8] is grid indices, then per 32
    # values a uint32 of signs and scale. IQ2_XXS's qs: per 32 values, 4 grid indices and such a
    # uint32; IQ2_XS's: uint16 each, a 9-bit index and 7 sign bits; IQ1_S's qh: uint16 each;
    # IQ1_M has no d: its f16 scale is spread over the top nibbles of its scales.
    _quant(T.IQ2_XXS, QK_K, d=2, qs=QK_K // 4),
    _quant(T.IQ2_XS, QK_K, d=2, qs=QK_K // 4, scales=QK_K // 32),
    _quant(T.IQ2_S, QK_K, d=2, qs=QK_K // 8, signs=QK_K // 8, qh=QK_K // 32, scales=QK_K // 32),
    _quant(T.IQ3_XXS, QK_K, d=2, qs=QK_K // 4, scales_and_signs=QK_K // 8),
    _quant(T.IQ3_S, QK_K, d=2, qs=QK_K // 4, qh=QK_K // 32, signs=QK_K // 8, scales=QK_K // 64),
    _quant(T.IQ1_S, QK_K, d=2, qs=QK_K // 8, qh=QK_K // 16),
    _quant(T.IQ1_M, QK_K, qs=QK_K // 8, qh=QK_K // 16, scales=QK_K // 32),
    _quant(T.IQ4_NL, QK4_NL, d=2, qs=QK4_NL // 2),
    _quant(T.IQ4_XS, QK_K, d=2, scales_h=2, scales_l=QK_K // 64, qs=QK_K // 2),
    # TQ1_0 packs five trits a byte in qs and four in qh; TQ2_0 four 2-bit values a byte.
    _quant(T.TQ1_0, QK_K, qs=(QK_K - 4 * QK_K // 64) // 5, qh=QK_K // 64, d=2),
    _quant(T.TQ2_0, QK_K, qs=QK_K // 4, d=2),
    _quant(T.I32, 1, value=4, decoded=False),  # hash-routing tables (tid2eid)
)}
DECODED: tuple[T, ...] = tuple(t for t, q in QUANTS.items() if q.decoded)


def block_sizes(ggml_type: T) -> tuple[int, int]:
    """(values, bytes) of one block of any ggml type: a registered type's from its parts, any other
    from gguf-py's table."""
    quant = QUANTS.get(ggml_type)
    return (quant.values, quant.nbytes) if quant is not None else GGML_QUANT_SIZES[ggml_type]


def nbytes_of(ggml_type: T, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml shape `shape` (whole blocks along shape[0])."""
    block_values, block_bytes = block_sizes(ggml_type)
    n = 1
    for d in shape:
        n *= d
    return n // block_values * block_bytes
