"""The i-quants (IQ1_S .. IQ4_XS) and ternary quants (TQ1_0, TQ2_0) dequantized in torch, bit for
bit equal to gguf-py's reference, on CPU and CUDA alike: weights/quant.py's contract (the
reference's float32 operations in its order, no fused multiply-add), for the types whose values
come from lookup tables rather than from arithmetic on the codes alone.

The tables (the grids of 4 or 8 values an index selects, the 7-bit -> 8 signs table, IQ4_NL's 16
values) are gguf-py's, the same bytes as ggml-common.h: read once at import into host tensors and
copied to a device the first time a block there needs them. No table is written out here, so
there is one copy of each to keep right. Registered into quant.py's table: dequantize there is
the one entry point."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from gguf import GGMLQuantizationType as T, quants

from .blocks import bits, f16, nibble_pairs, nibbles, parts, u16, u32


def _grid(cls: type) -> torch.Tensor:
    """A type's grid as [entries, values per entry] float32 (gguf-py unpacks it on first use)."""
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


def _sign_table(ksigns: bytes) -> torch.Tensor:
    """ggml's ksigns (a 7-bit index -> 8 sign bits, the 8th one making the parity even) as
    [128, 8] float32 factors +1 / -1, so that a lookup gives the signs ready to multiply."""
    table = torch.frombuffer(bytearray(ksigns), dtype=torch.uint8).reshape(-1, 1)
    return 1.0 - 2.0 * bits(table, 8).to(torch.float32)


def _packed(values: torch.Tensor) -> torch.Tensor:
    """A grid [entries, 4 or 8] of small integers (|v| < 128) as int8 bytes, an entry per 32- or
    64-bit word, viewed as float32 words to sit in the kernels' one table array: the per-block
    decoders load an entry with one load and take its values apart in registers, exactly."""
    as_int8 = values.to(torch.int8)
    assert torch.equal(as_int8.to(values.dtype), values)
    return as_int8.contiguous().view(torch.float32).reshape(-1)


_HOST_TABLES: dict[str, torch.Tensor] = {
    "iq2xxs": _grid(quants.IQ2_XXS),
    "iq2xs": _grid(quants.IQ2_XS),
    "iq2s": _grid(quants.IQ2_S),
    "iq3xxs": _grid(quants.IQ3_XXS),
    "iq3s": _grid(quants.IQ3_S),
    "iq1s": _grid(quants.IQ1_S),  # IQ1_M shares it
    "ksigns": _sign_table(quants.IQ2_XXS.ksigns),
    "iq4nl": torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32),
}
IQ1_DELTA = float(quants.IQ1_S.delta)  # the offset IQ1_S/IQ1_M add to a grid value, sign per group

# The same tables end to end in one float32 array for the Triton decoders (kernels/dequant_tl.py),
# which take one pointer and find each table at its offset here (in float32 words, each table
# 16-byte aligned): the grids packed (_packed), ggml's ksigns as its 128 bytes, IQ4_NL's values.
_KERNEL_TABLES = {
    **{f"{name}_i8": _packed(_HOST_TABLES[name]) for name in ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s")},
    "ksigns_u8": torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).view(torch.float32),
    "iq4nl": _HOST_TABLES["iq4nl"],
}
KERNEL_TABLE_OFFSETS: dict[str, int] = {}
_pieces: list[torch.Tensor] = []
_at = 0
for _name, _t in _KERNEL_TABLES.items():
    KERNEL_TABLE_OFFSETS[_name] = _at
    _n = -(-_t.numel() // 4) * 4
    _pieces.append(torch.cat([_t.reshape(-1), torch.zeros(_n - _t.numel())]))
    _at += _n
_HOST_KERNEL_TABLE = torch.cat(_pieces)


@lru_cache(maxsize=None)
def kernel_tables(device: torch.device) -> torch.Tensor:
    """Every table, flat, on `device` (copied once): what the kernels' `tab` pointer points at."""
    return _HOST_KERNEL_TABLE.to(device)


@lru_cache(maxsize=None)
def _table(name: str, device: torch.device) -> torch.Tensor:
    """A table on `device`, copied there once: dequantize runs per use, the copy must not."""
    return _HOST_TABLES[name].to(device)


def _shifted(x: torch.Tensor, shifts: tuple[int, ...]) -> torch.Tensor:
    """[n, m] -> [n, m, len(shifts)]: each value shifted right by each shift (a packed field's parts)."""
    return x.unsqueeze(-1) >> torch.tensor(shifts, device=x.device, dtype=x.dtype)


def _sign_factors(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes of plain sign bits -> [n, 8k] float32 +1 (bit clear) / -1 (bit set)."""
    return 1.0 - 2.0 * bits(b, 8 * b.shape[1]).to(torch.float32)


def _half_scales(d: torch.Tensor, codes: torch.Tensor, step: float) -> torch.Tensor:
    """The IQ2/IQ3_XXS block scales, d * (0.5 + code) * step, in the reference's order."""
    return (d * (0.5 + codes.to(torch.float32))) * step


# ---- one function per type; `blocks` is [n, block bytes] ----------------------------------------
def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs = parts(blocks, T.IQ2_XXS)
    qs = qs.reshape(n, 8, 8)  # per 32 values: 4 grid indices, then a uint32 of 4 x 7 sign bits and a scale
    aux = u32(qs[:, :, 4:].reshape(n, 32))  # [n, 8]
    db = _half_scales(f16(d), aux >> 28, 0.25).reshape(n, 8, 1, 1)
    signs = _table("ksigns", blocks.device)[_shifted(aux, (0, 7, 14, 21)) & 0x7F]  # [n, 8, 4, 8]
    grid = _table("iq2xxs", blocks.device)[qs[:, :, :4].long()]  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, -1)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, scales = parts(blocks, T.IQ2_XS)
    qs = u16(qs).long()  # [n, 32]: a 9-bit grid index and 7 sign bits each
    db = _half_scales(f16(d), nibble_pairs(scales), 0.25).reshape(n, 16, 1, 1)
    signs = _table("ksigns", blocks.device)[qs >> 9].reshape(n, 16, 2, 8)
    grid = _table("iq2xs", blocks.device)[qs & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, signs, qh, scales = parts(blocks, T.IQ2_S)
    db = _half_scales(f16(d), nibble_pairs(scales), 0.25).reshape(n, 16, 1, 1)
    high = (_shifted(qh, (0, 2, 4, 6)) & 3).reshape(n, 32)  # the grid indices' bits 8-9
    index = qs.long() | (high.long() << 8)
    grid = _table("iq2s", blocks.device)[index].reshape(n, 16, 2, 8)
    return (db * grid * _sign_factors(signs).reshape(n, 16, 2, 8)).reshape(n, -1)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, scales_and_signs = parts(blocks, T.IQ3_XXS)
    aux = u32(scales_and_signs)  # [n, 8]: per 32 values, 4 x 7 sign bits and a 4-bit scale
    db = _half_scales(f16(d), aux >> 28, 0.5).reshape(n, 8, 1, 1)
    signs = _table("ksigns", blocks.device)[_shifted(aux, (0, 7, 14, 21)) & 0x7F]  # [n, 8, 4, 8]
    grid = _table("iq3xxs", blocks.device)[qs.long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, -1)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, qh, signs, scales = parts(blocks, T.IQ3_S)
    db = (f16(d) * (1 + 2 * nibble_pairs(scales)).to(torch.float32)).reshape(n, 8, 1, 1)
    index = qs.long() | (bits(qh, 64).long() << 8)  # a 9th index bit per grid entry
    grid = _table("iq3s", blocks.device)[index].reshape(n, 8, 4, 8)
    return (db * grid * _sign_factors(signs).reshape(n, 8, 4, 8)).reshape(n, -1)


def _iq1_grid_plus_delta(qs: torch.Tensor, high: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """IQ1_S/IQ1_M: grid[qs | high << 8] + delta, delta -IQ1_DELTA where `negative`; `high` and
    `negative` [n, 32] (one per grid entry) -> [n, 32, 8]."""
    grid = _table("iq1s", qs.device)[qs.long() | (high.long() << 8)]
    delta = torch.where(negative, -IQ1_DELTA, IQ1_DELTA).to(torch.float32)
    return grid + delta.unsqueeze(-1)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs, qh = parts(blocks, T.IQ1_S)
    qh = u16(qh)  # [n, 8]: per 32 values, 4 x 3 high index bits, a 3-bit scale, the delta's sign
    dl = (f16(d) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    high = (_shifted(qh, (0, 3, 6, 9)) & 7).reshape(n, 32)
    negative = ((qh & 0x8000) != 0).repeat_interleave(4, dim=1)
    return (dl * _iq1_grid_plus_delta(qs, high, negative).reshape(n, 8, 4, 8)).reshape(n, -1)


def _iq1_m_scale(scales: torch.Tensor) -> torch.Tensor:
    """IQ1_M's f16 block scale, whose 16 bits are the top nibbles of its four uint16 scale words."""
    words = u16(scales)  # [n, 4]
    top = (words & 0xF000) >> torch.tensor((12, 8, 4, 0), device=words.device, dtype=words.dtype)
    d_bits = top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]
    return f16(torch.stack([d_bits & 0xFF, d_bits >> 8], dim=1).to(torch.uint8))


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs, qh, scales = parts(blocks, T.IQ1_M)
    sub = (_shifted(u16(scales), (0, 3, 6, 9)) & 7).reshape(n, 16)  # a 3-bit scale per 16 values
    dl = (_iq1_m_scale(scales) * (2 * sub + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    halves = _shifted(qh, (0, 4)).reshape(n, 32)  # per grid entry: 3 high index bits, the delta's sign
    values = _iq1_grid_plus_delta(qs, halves & 7, (halves & 8) != 0)
    return (dl * values.reshape(n, 8, 2, 2, 8)).reshape(n, -1)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = parts(blocks, T.IQ4_NL)
    return f16(d) * _table("iq4nl", blocks.device)[nibbles(qs).long()]


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, scales_h, scales_l, qs = parts(blocks, T.IQ4_XS)
    high = _shifted(u16(scales_h), tuple(range(0, 16, 2))).reshape(n, 8) & 3
    scales = ((nibble_pairs(scales_l).to(torch.int32) | (high << 4)) - 32).to(torch.float32)
    dl = (f16(d) * scales).reshape(n, 8, 1)
    q = _table("iq4nl", blocks.device)[nibbles(qs.reshape(n, 8, 16)).long()]  # [n, 8, 32]
    return (dl * q).reshape(n, -1)


_POWERS_OF_3 = (1, 3, 9, 27, 81)


def _trits(b: torch.Tensor, powers: tuple[int, ...]) -> torch.Tensor:
    """TQ1_0: [n, k] bytes -> [n, len(powers) * k] trits 0..2, power by power: multiplying by 3^i
    (wrapping at 256, as uint8 does) brings trit i to the top, where (x * 3) >> 8 reads it."""
    p = torch.tensor(powers, device=b.device, dtype=torch.uint8).reshape(-1, 1)
    shifted = (b.unsqueeze(1) * p).reshape(b.shape[0], -1)
    return (shifted.to(torch.int32) * 3) >> 8


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    qs, qh, d = parts(blocks, T.TQ1_0)
    q = torch.cat([_trits(qs[:, :32], _POWERS_OF_3), _trits(qs[:, 32:], _POWERS_OF_3),
                   _trits(qh, _POWERS_OF_3[:4])], dim=1)
    return f16(d) * (q - 1).to(torch.float32)


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs, d = parts(blocks, T.TQ2_0)
    q = (_shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6)) & 3).transpose(2, 3).reshape(n, -1)  # [n, 256]
    return f16(d) * (q.to(torch.int32) - 1).to(torch.float32)


IQ_DEQUANT: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
}
