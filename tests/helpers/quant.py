"""Quantized blocks for the dequantization and kernel tests: random ones (valid, or raw bytes) and
gguf-py's reference dequantization of them. Valid blocks of the types synth writes are synth's;
those of the i-quants and ternary quants (which synth does not write yet) are random bytes with a
finite f16 scale of random sign and magnitude, subnormals included: any code is a valid code."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from expertpack.packtools.quants import QUANTS
from expertpack.packtools.synth.quant_fill import FLOAT_TYPES, SCALES as FILLABLE, RandomFill

SHAPES = [(256,), (512, 3), (256, 7, 2), (1024, 1), (768, 5)]


def reference(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> np.ndarray:
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[1:], dtype=np.int64)))  # [rows, row_bytes]
    out = quants.dequantize(rows, ggml_type)
    return out.reshape(tuple(reversed(shape)))


def random_bytes(ggml_type: T, shape: tuple[int, ...], seed: int, valid: bool) -> np.ndarray:
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    nbytes = int(np.prod(shape)) // block_values * block_bytes
    if valid and ggml_type in FILLABLE:
        return RandomFill(seed).quant(ggml_type, nbytes).copy()
    if valid and ggml_type not in FLOAT_TYPES:
        return with_finite_scale(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8), ggml_type,
                                 seed)
    if valid:  # float types: finite values
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(int(np.prod(shape)), dtype=np.float32)
        return {T.F32: values, T.F16: values.astype(np.float16),
                T.BF16: (values.view(np.uint32) >> 16).astype(np.uint16)}[ggml_type].view(np.uint8)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def with_finite_scale(raw: np.ndarray, ggml_type: T, seed: int) -> np.ndarray:
    """raw (whole blocks) with every block's f16 scale `d` finite: random sign, magnitude from
    1e-7 (a subnormal) to 1. IQ1_M has no `d` part: its scale's 16 bits are the top nibbles of
    its four uint16 scale words, lowest bits in the first."""
    quant = QUANTS[ggml_type]
    blocks = raw.reshape(-1, quant.nbytes)
    rng = np.random.default_rng(seed + 1)
    d = (rng.choice([-1.0, 1.0], len(blocks)) * 10 ** rng.uniform(-7, 0, len(blocks))).astype(np.float16)
    if ggml_type == T.IQ1_M:
        d_bits = d.view(np.uint16)
        at = quant.offset("scales")
        for k in range(4):  # the high byte of word k holds bits 4k..4k+3 of d in its top nibble
            top = ((d_bits >> (4 * k)) & 0xF).astype(np.uint8) << 4
            blocks[:, at + 2 * k + 1] = (blocks[:, at + 2 * k + 1] & 0x0F) | top
    else:
        at = quant.offset("d")
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw
