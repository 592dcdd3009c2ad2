"""The i-quants' products with a vector, for the decode kernels (matvec, the experts' launches):
`iq_dot(QT, rowp, c, nmask, K, xp, tab)` gives [BN] sums over chunk c (256 values) of the rows at
rowp times the 256 floats at xp, for the grid types (IQ1_S .. IQ3_S) and IQ4_NL / IQ4_XS.

Why apart from dequant_tl's decoders: those give a chunk's values as [BN, 256], the shape every
kernel multiplies, but an i-quant's fields are per grid entry (4 or 8 values) and per group, and
putting entries' values into that shape cost Triton a layout conversion through shared memory per
field, about 30 instructions a value: on the H200 a layer's 8 IQ2_XXS experts read at 14 GB/s.
Here every tensor is [BN, 8], a row's eight 32-value groups, and an entry's values are unrolled
(static loops), so each thread owns whole groups: its fields load once, the products of a value
cost a byte extraction, the sign and one FMA, and no data crosses threads until the final sum.
x is read from memory, each value at its group's address (L1 serves the rows sharing it).

Values are quant_iq's (gguf-py's) bits; the sums take them in another order than a float64
reference (a group's products, then its scale), as block_dot does for MXFP4 and Q8_0: within the
kernels' tolerance, and the same bits wherever the bytes sit."""

from __future__ import annotations

import triton
import triton.language as tl

from .dequant_tl import (IQ1_DELTA_C, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS,
                         TAB_IQ1S_I8, TAB_IQ2S_I8, TAB_IQ2XS_I8, TAB_IQ2XXS_I8, TAB_IQ3S_I8, TAB_IQ3XXS_I8, TAB_IQ4NL,
                         _f16, _half_scale, _iq1_m_d, _iq4_xs_scale, _ksigns, _u8, _u16)

IQ_DOT_TYPES = tuple(int(t) for t in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_NL, IQ4_XS))


@triton.constexpr_function
def takes_iq_dot(qt) -> bool:
    """Whether the decode kernels take ggml type `qt` through iq_dot (a compile-time test)."""
    return int(qt) in IQ_DOT_TYPES


@triton.jit
def _unsigned(word, k: tl.constexpr):
    """Byte k of each word as an exact float32: the byte placed under 2^23's exponent, 2^23 taken off
    (the IQ2 and IQ3 grids hold magnitudes, their signs apart)."""
    return (((word >> (8 * k)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _signed(word, k: tl.constexpr):
    """Byte k of each word as a signed int8, exactly, as float32 (IQ1's grid of -1, 0, 1)."""
    return ((((word >> (8 * k)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _flip(v, signs, k: tl.constexpr):
    """v negated where bit k of signs is set: the sign bit toggled, exact."""
    return (v.to(tl.int32, bitcast=True) ^ (((signs >> k) & 1) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _x(xe, k: tl.constexpr, kin):
    return tl.load(xe + k, mask=kin, other=0.0)


@triton.jit
def _entry8(tab, at: tl.constexpr, index, m):
    """An 8-value grid entry (quant_iq._packed) as its two 32-bit halves, from one 64-bit load."""
    w = tl.load((tab + at).to(tl.pointer_type(tl.int64)) + index, mask=m, other=0)
    return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def _entry4(tab, at: tl.constexpr, index, m):
    return tl.load((tab + at).to(tl.pointer_type(tl.int32)) + index, mask=m, other=0)


@triton.jit
def _dot8(tab, at: tl.constexpr, index, signs, m, xe, kin):
    """An IQ2 entry's 8 products: grid magnitudes, sign bits 0..7 of `signs`."""
    lo, hi = _entry8(tab, at, index, m)
    s = _flip(_unsigned(lo, 0), signs, 0) * _x(xe, 0, kin)
    for k in tl.static_range(1, 4):
        s += _flip(_unsigned(lo, k), signs, k) * _x(xe, k, kin)
    for k in tl.static_range(4):
        s += _flip(_unsigned(hi, k), signs, k + 4) * _x(xe, k + 4, kin)
    return s


@triton.jit
def _dot4(tab, at: tl.constexpr, index, signs, first: tl.constexpr, m, xe, kin):
    """An IQ3 entry's 4 products, its signs bits first..first+3 of `signs`."""
    w = _entry4(tab, at, index, m)
    s = _flip(_unsigned(w, 0), signs, first) * _x(xe, 0, kin)
    for k in tl.static_range(1, 4):
        s += _flip(_unsigned(w, k), signs, first + k) * _x(xe, k, kin)
    return s


@triton.jit
def _dot8_iq1(tab, index, delta, m, xe, kin):
    """An IQ1 entry's 8 products: (grid value + delta) times x."""
    lo, hi = _entry8(tab, TAB_IQ1S_I8, index, m)
    s = (_signed(lo, 0) + delta) * _x(xe, 0, kin)
    for k in tl.static_range(1, 4):
        s += (_signed(lo, k) + delta) * _x(xe, k, kin)
    for k in tl.static_range(4):
        s += (_signed(hi, k) + delta) * _x(xe, k + 4, kin)
    return s


@triton.jit
def _byte(pair, i: tl.constexpr):
    """Byte i (0 or 1) of a 16-bit field."""
    return (pair >> (8 * i)) & 0xFF


@triton.jit
def _iq2_xxs(bp, g, m, xg, kin, tab):
    """d, then per group 4 index bytes and a word of 4 x 7 sign-table indices and a 4-bit scale."""
    gp = bp + 2 + 8 * g
    q01 = _u16(gp, m)
    q23 = _u16(gp + 2, m)
    aux = _u16(gp + 4, m) | (_u16(gp + 6, m) << 16)
    s = _dot8(tab, TAB_IQ2XXS_I8, _byte(q01, 0), _ksigns(tab, aux & 127, m), m, xg, kin)
    s += _dot8(tab, TAB_IQ2XXS_I8, _byte(q01, 1), _ksigns(tab, (aux >> 7) & 127, m), m, xg + 8, kin)
    s += _dot8(tab, TAB_IQ2XXS_I8, _byte(q23, 0), _ksigns(tab, (aux >> 14) & 127, m), m, xg + 16, kin)
    s += _dot8(tab, TAB_IQ2XXS_I8, _byte(q23, 1), _ksigns(tab, (aux >> 21) & 127, m), m, xg + 24, kin)
    return s * _half_scale(_f16(bp, m), (aux >> 28) & 15, 0.25)


@triton.jit
def _iq2_xs(bp, g, m, xg, kin, tab):
    """d, 32 uint16 (a 9-bit index, a 7-bit sign-table index), a 4-bit scale per 16 values."""
    d = _f16(bp, m)
    q = bp + 2 + 8 * g
    sc = _u8(bp + 66 + g, m)
    lo = _dot8(tab, TAB_IQ2XS_I8, _u16(q, m) & 511, _ksigns(tab, _u16(q, m) >> 9, m), m, xg, kin)
    lo += _dot8(tab, TAB_IQ2XS_I8, _u16(q + 2, m) & 511, _ksigns(tab, _u16(q + 2, m) >> 9, m), m, xg + 8, kin)
    hi = _dot8(tab, TAB_IQ2XS_I8, _u16(q + 4, m) & 511, _ksigns(tab, _u16(q + 4, m) >> 9, m), m, xg + 16, kin)
    hi += _dot8(tab, TAB_IQ2XS_I8, _u16(q + 6, m) & 511, _ksigns(tab, _u16(q + 6, m) >> 9, m), m, xg + 24, kin)
    return lo * _half_scale(d, sc & 15, 0.25) + hi * _half_scale(d, sc >> 4, 0.25)


@triton.jit
def _iq2_s(bp, g, m, xg, kin, tab):
    """d, 32 index bytes, 32 sign bytes, 2 high index bits each in qh, a 4-bit scale per 16 values."""
    d = _f16(bp, m)
    q01 = _u16(bp + 2 + 4 * g, m)
    q23 = _u16(bp + 4 + 4 * g, m)
    s01 = _u16(bp + 34 + 4 * g, m)
    s23 = _u16(bp + 36 + 4 * g, m)
    qh = _u8(bp + 66 + g, m)
    sc = _u8(bp + 74 + g, m)
    lo = _dot8(tab, TAB_IQ2S_I8, _byte(q01, 0) | ((qh & 3) << 8), _byte(s01, 0), m, xg, kin)
    lo += _dot8(tab, TAB_IQ2S_I8, _byte(q01, 1) | (((qh >> 2) & 3) << 8), _byte(s01, 1), m, xg + 8, kin)
    hi = _dot8(tab, TAB_IQ2S_I8, _byte(q23, 0) | (((qh >> 4) & 3) << 8), _byte(s23, 0), m, xg + 16, kin)
    hi += _dot8(tab, TAB_IQ2S_I8, _byte(q23, 1) | ((qh >> 6) << 8), _byte(s23, 1), m, xg + 24, kin)
    return lo * _half_scale(d, sc & 15, 0.25) + hi * _half_scale(d, sc >> 4, 0.25)


@triton.jit
def _iq3_xxs(bp, g, m, xg, kin, tab):
    """d, 64 index bytes (4-value entries), per group a word of 4 x 7 sign-table indices (each for
    two entries) and a 4-bit scale."""
    ap = bp + 66 + 4 * g
    aux = _u16(ap, m) | (_u16(ap + 2, m) << 16)
    s = tl.zeros(aux.shape, tl.float32)
    for h in tl.static_range(4):  # entries 2h, 2h + 1: one index pair, one sign byte
        pair = _u16(bp + 2 + 8 * g + 2 * h, m)
        signs = _ksigns(tab, (aux >> (7 * h)) & 127, m)
        s += _dot4(tab, TAB_IQ3XXS_I8, _byte(pair, 0), signs, 0, m, xg + 8 * h, kin)
        s += _dot4(tab, TAB_IQ3XXS_I8, _byte(pair, 1), signs, 4, m, xg + 8 * h + 4, kin)
    return s * _half_scale(_f16(bp, m), (aux >> 28) & 15, 0.5)


@triton.jit
def _iq3_s(bp, g, m, xg, kin, tab):
    """d, 64 index bytes (4-value entries), a 9th index bit each in qh, 32 sign bytes (one per two
    entries), a 4-bit scale per group."""
    qh = _u8(bp + 66 + g, m)
    s = tl.zeros(qh.shape, tl.float32)
    for h in tl.static_range(4):
        pair = _u16(bp + 2 + 8 * g + 2 * h, m)
        signs = _u8(bp + 74 + 4 * g + h, m)
        s += _dot4(tab, TAB_IQ3S_I8, _byte(pair, 0) | (((qh >> (2 * h)) & 1) << 8), signs, 0, m, xg + 8 * h, kin)
        s += _dot4(tab, TAB_IQ3S_I8, _byte(pair, 1) | (((qh >> (2 * h + 1)) & 1) << 8), signs, 4, m,
                   xg + 8 * h + 4, kin)
    code = (_u8(bp + 106 + g // 2, m) >> ((g % 2) * 4)) & 15
    return s * (_f16(bp, m) * (1 + 2 * code).to(tl.float32))


@triton.jit
def _iq1_s(bp, g, m, xg, kin, tab):
    """d, 32 index bytes, per group a uint16: 4 x 3 high index bits, a 3-bit scale, delta's sign."""
    qh = _u16(bp + 34 + 2 * g, m)
    q01 = _u16(bp + 2 + 4 * g, m)
    q23 = _u16(bp + 4 + 4 * g, m)
    delta = tl.where((qh & 0x8000) != 0, -IQ1_DELTA_C, IQ1_DELTA_C)
    s = _dot8_iq1(tab, _byte(q01, 0) | ((qh & 7) << 8), delta, m, xg, kin)
    s += _dot8_iq1(tab, _byte(q01, 1) | (((qh >> 3) & 7) << 8), delta, m, xg + 8, kin)
    s += _dot8_iq1(tab, _byte(q23, 0) | (((qh >> 6) & 7) << 8), delta, m, xg + 16, kin)
    s += _dot8_iq1(tab, _byte(q23, 1) | (((qh >> 9) & 7) << 8), delta, m, xg + 24, kin)
    return s * (_f16(bp, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32))


@triton.jit
def _iq1_m_entry(q, half, m, xg, kin, tab):
    """An IQ1_M entry: its index byte, its nibble (3 high index bits, delta's sign)."""
    delta = tl.where((half & 8) != 0, -IQ1_DELTA_C, IQ1_DELTA_C)
    return _dot8_iq1(tab, q | ((half & 7) << 8), delta, m, xg, kin)


@triton.jit
def _iq1_m(bp, g, m, xg, kin, tab):
    """32 index bytes, a nibble per entry, 4 uint16 of 3-bit scales (one per 16 values) whose top
    nibbles hold d."""
    d = _iq1_m_d(bp, m)
    q01 = _u16(bp + 4 * g, m)
    q23 = _u16(bp + 2 + 4 * g, m)
    halves = _u16(bp + 32 + 2 * g, m)  # the group's four nibbles
    word = _u16(bp + 48 + 2 * (g // 2), m) >> (6 * (g % 2))  # scales 2g and 2g + 1 in its low 6 bits
    lo = _iq1_m_entry(_byte(q01, 0), halves & 15, m, xg, kin, tab)
    lo += _iq1_m_entry(_byte(q01, 1), (halves >> 4) & 15, m, xg + 8, kin, tab)
    hi = _iq1_m_entry(_byte(q23, 0), (halves >> 8) & 15, m, xg + 16, kin, tab)
    hi += _iq1_m_entry(_byte(q23, 1), halves >> 12, m, xg + 24, kin, tab)
    return lo * (d * (2 * (word & 7) + 1).to(tl.float32)) + hi * (d * (2 * ((word >> 3) & 7) + 1).to(tl.float32))


@triton.jit
def _dot16_iq4(tab, pair, m, xe, kin):
    """Two bytes' four IQ4_NL values (low nibbles at xe and xe + 1, high ones 16 further): ggml's
    16 non-uniform levels, looked up in the kernels' table (L1 serves the 16 floats)."""
    s = tl.load(tab + TAB_IQ4NL + (pair & 15), mask=m, other=0.0) * _x(xe, 0, kin)
    s += tl.load(tab + TAB_IQ4NL + ((pair >> 8) & 15), mask=m, other=0.0) * _x(xe, 1, kin)
    s += tl.load(tab + TAB_IQ4NL + ((pair >> 4) & 15), mask=m, other=0.0) * _x(xe, 16, kin)
    s += tl.load(tab + TAB_IQ4NL + ((pair >> 12) & 15), mask=m, other=0.0) * _x(xe, 17, kin)
    return s


@triton.jit
def _iq4_group(qp, m, xg, kin, tab):
    """A 32-value group's 16 nibble bytes at qp (2-byte aligned) against x: value j < 16 the low
    nibble of byte j, value 16 + j its high nibble."""
    s = _dot16_iq4(tab, _u16(qp, m), m, xg, kin)
    for h in tl.static_range(1, 8):
        s += _dot16_iq4(tab, _u16(qp + 2 * h, m), m, xg + 2 * h, kin)
    return s


@triton.jit
def _iq4_xs(bp, g, m, xg, kin, tab):
    """d, the scales' high bits (2 a group), their low nibbles, then 16 nibble bytes a group."""
    return _iq4_group(bp + 8 + 16 * g, m, xg, kin, tab) * _iq4_xs_scale(bp, g, m)


@triton.jit
def iq_dot(QT: tl.constexpr, rowp, c, nmask, K, xp, tab):
    """[BN] sums of chunk c of the rows at rowp ([BN, 1] uint8 pointers) times x at xp (the chunk's
    256 floats, zero past K); nmask [BN, 1] the rows that exist."""
    g = tl.arange(0, 8)[None, :]
    xg = xp + 32 * g
    kin = c * 256 < K  # a superblock type's row ends at a chunk
    mr = nmask & kin
    if QT == IQ4_NL:  # 32-value blocks, a group each: a row may end inside the chunk
        gin = c * 256 + 32 * g < K
        bp = rowp + (c * 8 + g) * 18
        s = _iq4_group(bp + 2, nmask & gin, xg, gin, tab) * _f16(bp, nmask & gin)
    elif QT == IQ4_XS:
        s = _iq4_xs(rowp + c * 136, g, mr, xg, kin, tab)
    elif QT == IQ2_XXS:
        s = _iq2_xxs(rowp + c * 66, g, mr, xg, kin, tab)
    elif QT == IQ2_XS:
        s = _iq2_xs(rowp + c * 74, g, mr, xg, kin, tab)
    elif QT == IQ2_S:
        s = _iq2_s(rowp + c * 82, g, mr, xg, kin, tab)
    elif QT == IQ3_XXS:
        s = _iq3_xxs(rowp + c * 98, g, mr, xg, kin, tab)
    elif QT == IQ3_S:
        s = _iq3_s(rowp + c * 110, g, mr, xg, kin, tab)
    elif QT == IQ1_S:
        s = _iq1_s(rowp + c * 50, g, mr, xg, kin, tab)
    else:
        tl.static_assert(QT == IQ1_M, "iq_dot: not an i-quant it takes")
        s = _iq1_m(rowp + c * 56, g, mr, xg, kin, tab)
    return tl.sum(s, axis=1)
