"""GGUF blocks decoded inside Triton kernels: `chunk(QT, rowp, c, j, m, tab)` turns chunk `c` of a row
(256 values: one K-quant superblock, eight 32-value blocks, or 256 plain floats) into float32
registers, straight from the GGUF bytes; no float copy of a weight is written anywhere.

Each decoder below is the arithmetic of worker/weights/quant.py (which is gguf-py's, bit for bit)
written per value: `j` is the value's index in its chunk, every byte it needs is loaded at the offset
the block's parts give (packtools.quants, the registry; written out here as literals, which
tests/kernels check for every type against quant.py's decoders, which split blocks by the registry);
the hot types (Q4_K, Q8_0, MXFP4: the `_rows` decoders) are written per block instead, each byte
loaded once. The f16 scales sit at even offsets of blocks of even size, so they load as float16;
everything else loads as bytes. One layout is not ggml's: Q8_0R (weights.quant.Q8_0_REGROUPED), Q8_0
rows regrouped where the kernels run (weights.regroup_q8_0). The i-quants' values come from grids
(weights/quant_iq.py, gguf-py's tables): every kernel takes one pointer `tab` to all of them, flat
on the device (quant_iq.kernel_tables), the grids packed as int8 bytes so that one 32- or 64-bit
load gives an entry's 4 or 8 values; the arithmetic on scales is quant_iq's, so the values are its
bits. The decode kernels take the i-quants through iq_dot_tl instead, which never forms the
[BN, 256] shape (its docstring says why).
`rowp` [BN, 1] points at each row's first byte, `m` [BN, CH] masks rows and values past the row's
end (only the 32-value and float types can end inside a chunk)."""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ..weights.quant import Q8_0_REGROUPED
from ..weights.quant_iq import IQ1_DELTA, KERNEL_TABLE_OFFSETS

# ggml type ids, as kernel constants.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (tl.constexpr(int(t)) for t in (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0,
                                                                          T.Q5_1, T.Q8_0))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, MXFP4 = (tl.constexpr(int(t)) for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                                                                            T.BF16, T.MXFP4))
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = (tl.constexpr(int(t)) for t in (
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M))
IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 = (tl.constexpr(int(t)) for t in (T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0))
# Where each lookup table starts in the float32 array `tab` points at (weights.quant_iq.kernel_tables).
TAB_IQ4NL = tl.constexpr(KERNEL_TABLE_OFFSETS["iq4nl"])
TAB_IQ2XXS_I8, TAB_IQ2XS_I8, TAB_IQ2S_I8, TAB_IQ3XXS_I8, TAB_IQ3S_I8, TAB_IQ1S_I8, TAB_KSIGNS_U8 = (
    tl.constexpr(KERNEL_TABLE_OFFSETS[name]) for name in ("iq2xxs_i8", "iq2xs_i8", "iq2s_i8", "iq3xxs_i8", "iq3s_i8",
                                                          "iq1s_i8", "ksigns_u8"))
IQ1_DELTA_C = tl.constexpr(IQ1_DELTA)
Q8_0R = tl.constexpr(Q8_0_REGROUPED)  # Q8_0 regrouped (weights.regroup_q8_0): per chunk 8 f16 scales, then 256 quants
CHUNK = 256  # values decoded per step along a row, for every type


@triton.jit
def _u8(p, m):
    return tl.load(p, mask=m, other=0).to(tl.int32)


@triton.jit
def _i8(p, m):
    return tl.load(p.to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.int32)


@triton.jit
def _f16(p, m):
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=m, other=0).to(tl.float32)


@triton.jit
def _nibble32(qs, jj, m):
    """32-value blocks: value jj < 16 is the low nibble of qs[jj], the rest the high nibble of qs[jj-16]."""
    return (_u8(qs + (jj % 16), m) >> ((jj // 16) * 4)) & 0xF


@triton.jit
def _bit32(qh, jj, m):
    return (_u8(qh + jj // 8, m) >> (jj % 8)) & 1


@triton.jit
def _q4_0(bp, jj, m):  # d, qs[16]
    q = _nibble32(bp + 2, jj, m) - 8
    return _f16(bp, m) * q.to(tl.float32)


@triton.jit
def _q4_1(bp, jj, m):  # d, m, qs[16]
    q = _nibble32(bp + 4, jj, m)
    return _f16(bp, m) * q.to(tl.float32) + _f16(bp + 2, m)


@triton.jit
def _q5_0(bp, jj, m):  # d, qh[4], qs[16]
    q = (_nibble32(bp + 6, jj, m) | (_bit32(bp + 2, jj, m) << 4)) - 16
    return _f16(bp, m) * q.to(tl.float32)


@triton.jit
def _q5_1(bp, jj, m):  # d, m, qh[4], qs[16]
    q = _nibble32(bp + 8, jj, m) | (_bit32(bp + 4, jj, m) << 4)
    return _f16(bp, m) * q.to(tl.float32) + _f16(bp + 2, m)


@triton.jit
def _mxfp4_words(bp, mb):
    """The MXFP4 blocks (e: E8M0, qs[16]: e2m1 nibbles) at bp [BN, NB]: e [BN, NB] and the quant
    bytes as four little-endian words [BN, NB, 4]. A block is 17 bytes, so its words sit at any
    alignment: each is cut from the two aligned words around it (a funnel shift); each of the five
    aligned words holds a byte of the block, so no load leaves the pool. Byte loads cost an
    instruction per byte."""
    lead = (bp.to(tl.int64) & 3).to(tl.int32)  # the block's offset in its aligned word
    wp = (bp - lead).to(tl.pointer_type(tl.uint32))[:, :, None] + tl.arange(0, 4)[None, None, :]
    m3 = mb[:, :, None]
    lo = tl.load(wp, mask=m3, other=0).to(tl.uint64)
    hi = tl.load(wp + 1, mask=m3, other=0).to(tl.uint64)
    q = ((hi << 32) | lo) >> ((lead + 1) * 8).to(tl.uint64)[:, :, None]  # qs starts a byte after e
    return _u8(bp, mb), q.to(tl.uint32)


@triton.jit
def _e2m1_scaled(q):
    """The 32 values of each block of q [BN, NB, 4] as [BN, NB, 2, 4, 4] (block, nibble, word, byte:
    value 16 * nibble + 4 * word + byte), each e2m1 value times 2^-14: its sign and three bits
    placed in a float16's (exact, 0.5 a subnormal), one conversion instead of a table or a chain of
    selects."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    b = tl.arange(0, 4)[None, None, None, None, :]
    t = tl.reshape(q, (q.shape[0], q.shape[1], 1, 4, 1)) >> (b * 8 + h * 4).to(tl.uint32)
    bits = ((t & 8) << 12) | ((t & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0_half(e):
    """2^(e - 128) as float32, quant.py's (ggml's) factor for doubled e2m1 values: e < 2 subnormal,
    and finite for every e (2^(e - 127) overflows at e = 255, where quant.py's values stay finite)."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_rows(rowp, c, m, BN: tl.constexpr):
    """MXFP4 values [BN, 256]; a row ends at a block: the mask per block."""
    mb = tl.max(tl.reshape(m.to(tl.int32), (BN, 8, 32)), axis=2) > 0
    e, q = _mxfp4_words(rowp + (c * 8 + tl.arange(0, 8)[None, :]) * 17, mb)
    scale = tl.reshape(_e8m0_half(e), (BN, 8, 1, 1, 1))  # after 2^15: the doubled values, as quant.py's
    return tl.reshape(_e2m1_scaled(q) * 32768.0 * scale, (BN, 256))


@triton.jit
def mxfp4_dot(rowp, c, nmask, K, xv):
    """[BN] sums of chunk c's MXFP4 values of the rows at rowp times xv [1, 256] (zero past K),
    nmask [BN, 1] the rows that exist: each block's 32 products summed, then scaled once, the
    decode kernels' use of a chunk (through block_dot)."""
    BN: tl.constexpr = rowp.shape[0]
    blk = c * 8 + tl.arange(0, 8)[None, :]
    e, q = _mxfp4_words(rowp + blk * 17, nmask & (blk * 32 < K))
    prod = _e2m1_scaled(q) * tl.reshape(xv, (1, 8, 2, 4, 4))
    sums = tl.sum(tl.reshape(prod, (BN, 8, 32)), axis=2)
    return tl.sum(sums * 32768.0 * _e8m0_half(e), axis=1)


@triton.jit
def _q2_k(bp, j, m):  # scales[16], qs[64], d, dmin
    q = (_u8(bp + 16 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
    sc = _u8(bp + j // 16, m)
    dl = _f16(bp + 80, m) * (sc & 0xF).to(tl.float32)
    ml = _f16(bp + 82, m) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(bp, j, m):  # hmask[32], qs[64], scales[12], d
    low2 = (_u8(bp + 32 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
    high = (_u8(bp + j % 32, m) >> (j // 32)) & 1
    q = low2 - ((high ^ 1) << 2)
    s = j // 16
    low4 = (_u8(bp + 96 + s % 8, m) >> ((s // 8) * 4)) & 0xF
    high2 = (_u8(bp + 104 + s % 4, m) >> ((s // 4) * 2)) & 3
    scale = (low4 | (high2 << 4)) - 32
    return (_f16(bp + 108, m) * scale.to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _k_scale_min(sp, s, m):
    """Q4_K/Q5_K: the six-bit scale and min of sub-block s (0..7) from the 12 packed bytes at sp."""
    a = _u8(sp + s % 4, m)
    b = _u8(sp + s % 4 + 4, m)
    c = _u8(sp + s % 4 + 8, m)
    lo = s < 4
    sc = tl.where(lo, a & 63, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc, mn


@triton.jit
def _q5_k(bp, j, m):  # d, dmin, scales[12], qh[32], qs[128]
    low = (_u8(bp + 48 + (j // 64) * 32 + j % 32, m) >> (((j // 32) % 2) * 4)) & 0xF
    q = low | (((_u8(bp + 16 + j % 32, m) >> (j // 32)) & 1) << 4)
    sc, mn = _k_scale_min(bp + 4, j // 32, m)
    return (_f16(bp, m) * sc.to(tl.float32)) * q.to(tl.float32) - _f16(bp + 2, m) * mn.to(tl.float32)


@triton.jit
def _q6_k(bp, j, m):  # ql[128], qh[64], scales[16] (int8), d
    r = j % 128
    low = (_u8(bp + (j // 128) * 64 + r % 64, m) >> ((r // 64) * 4)) & 0xF
    high = (_u8(bp + 128 + (j // 128) * 32 + r % 32, m) >> ((r // 32) * 2)) & 3
    q = (low | (high << 4)) - 32
    return (_f16(bp + 208, m) * _i8(bp + 192 + j // 16, m).to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _q8_0_rows(rowp, c, m, BN: tl.constexpr):
    """Q8_0, eight blocks at once as [BN, 8, 32]: one scale load per block, the 32 quants of a
    block contiguous (the per-value form loads the scale 32 times). Bytes, not words: reading the
    2-byte-aligned quants as int16 pairs measured slower on the H200 (the split costs more than
    the loads it saves). The decode kernels read Q8_0 as words (_q8_0_values, q8_0_dot); those
    were not timed in the prompt kernels that use this one."""
    b = tl.arange(0, 8)[None, :, None]
    jj = tl.arange(0, 32)[None, None, :]
    bp = rowp[:, :, None] + (c * 8 + b) * 34  # [BN, 8, 1]
    m3 = tl.reshape(m, (BN, 8, 32))
    mb = tl.reshape(tl.max(m3.to(tl.int32), axis=2), (BN, 8, 1)) > 0
    d = _f16(bp, mb)
    q = _i8(bp + 2 + jj, m3).to(tl.float32)
    return tl.reshape(q * d, (BN, 256))


@triton.jit
def _q8_0r_rows(rowp, c, m, BN: tl.constexpr):
    """Regrouped Q8_0 (weights.regroup_q8_0) as _q8_0_rows gives Q8_0: a chunk's eight scales,
    then its quants, contiguous."""
    bp = rowp[:, :, None] + c * 272  # [BN, 1, 1]
    b = tl.arange(0, 8)[None, :, None]
    m3 = tl.reshape(m, (BN, 8, 32))
    mb = tl.reshape(tl.max(m3.to(tl.int32), axis=2), (BN, 8, 1)) > 0
    d = _f16(bp + b * 2, mb)
    q = _i8(bp + 16 + b * 32 + tl.arange(0, 32)[None, None, :], m3).to(tl.float32)
    return tl.reshape(q * d, (BN, 256))


@triton.jit
def _q8_0_values(qp, mb):
    """The int8 quants of the Q8_0 blocks (d, qs[32]) whose qs are at qp [BN, NB], as exact float32
    [BN, NB, 8, 4] (value 4 * word + byte): read as words, cut as MXFP4's (qs sit at the even
    offsets of 34-byte blocks), each byte made a float by the 2^23 trick (offset by 128, placed
    as a float's mantissa, 2^23 + 128 taken off), where byte loads cost an instruction a value."""
    lead = (qp.to(tl.int64) & 3).to(tl.int32)
    wp = (qp - lead).to(tl.pointer_type(tl.uint32))[:, :, None] + tl.arange(0, 8)[None, None, :]
    lo = tl.load(wp, mask=mb[:, :, None], other=0).to(tl.uint64)
    hi = tl.load(wp + 1, mask=(mb & (lead > 0))[:, :, None], other=0).to(tl.uint64)  # aligned: a word past the block
    w = (((hi << 32) | lo) >> (lead * 8).to(tl.uint64)[:, :, None]).to(tl.uint32)  # [BN, NB, 8]
    byte = (tl.reshape(w, (w.shape[0], w.shape[1], 8, 1)) >> (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, None, :]) & 0xFF
    return ((byte ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128


@triton.jit
def q8_0_dot(rowp, c, nmask, K, xv):
    """As mxfp4_dot for Q8_0: a block's 32 products summed, then times its d."""
    BN: tl.constexpr = rowp.shape[0]
    blk = c * 8 + tl.arange(0, 8)[None, :]
    mb = nmask & (blk * 32 < K)
    qp = rowp + blk * 34 + 2  # [BN, 8]
    sums = tl.sum(tl.reshape(_q8_0_values(qp, mb) * tl.reshape(xv, (1, 8, 8, 4)), (BN, 8, 32)), axis=2)
    return tl.sum(sums * _f16(qp - 2, mb), axis=1)


@triton.jit
def mxfp4_block(rowp, b, mb):
    """Block b (32 values) of the MXFP4 rows at rowp [BN, 1] as float32 [BN, 32], mb [BN, 1] the
    rows whose block exists: moe_grouped's K step, where a 256-value chunk makes the products'
    operands too large for registers."""
    e, q = _mxfp4_words(rowp + b * 17, mb)
    return tl.reshape(_e2m1_scaled(q), (rowp.shape[0], 32)) * 32768.0 * _e8m0_half(e)


@triton.jit
def _q4_k_rows(rowp, c, m, BN: tl.constexpr):
    """Q4_K as [BN, 4, 2, 32] (32-byte group, low/high nibble, byte): the quants read as int32 words
    (a block's 144 bytes keep them 4-byte aligned), each giving eight values; scales once per
    sub-block, d and dmin once per row. The words are addressed through an int32 pointer plus word
    offsets, so that Triton sees a group's eight words contiguous and puts lanes along them: a
    warp's load takes whole 32-byte sectors of four rows. Byte offsets cast to an int32 pointer hid
    that; its layout put the lanes across 16 rows (four bytes used a sector per load) and the decode
    kernels took more registers (gate/up 143 against 128: bench/kernel_registers.py)."""
    bp = rowp + c * 144  # [BN, 1]
    mr = tl.reshape(tl.max(m.to(tl.int32), axis=1), (BN, 1)) > 0  # the row's mask (a K-quant row ends at a chunk)
    s8 = tl.arange(0, 8)[None, :]
    sc, mn = _k_scale_min(bp + 4, s8, mr)  # [BN, 8], sub-block s = 2 * group + nibble
    d = _f16(bp, mr)
    dmin = _f16(bp + 2, mr)
    scale = tl.reshape(d * sc.to(tl.float32), (BN, 4, 2, 1, 1))
    offset = tl.reshape(dmin * mn.to(tl.float32), (BN, 4, 2, 1, 1))
    g = tl.arange(0, 4)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    w4 = tl.arange(0, 8)[None, None, None, :, None]
    b = tl.arange(0, 4)[None, None, None, None, :]
    wp = (bp + 16).to(tl.pointer_type(tl.int32))[:, :, None, None, None] + g * 8 + w4
    word = tl.load(wp, mask=mr[:, :, None, None, None], other=0)  # [BN, 4, 1, 8, 1]: byte l = 4 * w4 + b
    q = (word >> (b * 8 + h * 4)) & 0xF  # [BN, 4, 2, 8, 4]
    return tl.reshape(scale * q.to(tl.float32) - offset, (BN, 256))


@triton.jit
def q4_k_integer_rows(rowp, c, m, BN: tl.constexpr):
    """Superblock c of the Q4_K rows at rowp [BN, 1] in integer form (moe_integer): the value at k is
    d * I[k] - M[k // 32], with I = scale * (quant - 8) (in [-504, 441]: exact in float16), d the row's
    superblock scale, M = dmin * min - 8 * d * scale per 32-value block (both products exact in
    float32, their difference rounded once). Centred quants keep I . x small where x is not: with
    scale * quant >= 0, a row of activations away from zero made a large sum that the mins' term
    then cancelled, and the tensor cores truncate their sums. -> I [BN, 256] float32 (integers),
    d [BN, 1], M [BN, 8]."""
    bp = rowp + c * 144
    mr = tl.reshape(tl.max(m.to(tl.int32), axis=1), (BN, 1)) > 0
    s8 = tl.arange(0, 8)[None, :]
    sc, mn = _k_scale_min(bp + 4, s8, mr)  # [BN, 8], sub-block s = 2 * group + nibble
    g = tl.arange(0, 4)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    w4 = tl.arange(0, 8)[None, None, None, :, None]
    b = tl.arange(0, 4)[None, None, None, None, :]
    wp = (bp + 16).to(tl.pointer_type(tl.int32))[:, :, None, None, None] + g * 8 + w4  # as _q4_k_rows
    word = tl.load(wp, mask=mr[:, :, None, None, None], other=0)
    q = ((word >> (b * 8 + h * 4)) & 0xF) - 8  # [BN, 4, 2, 8, 4]
    ints = tl.reshape(sc, (BN, 4, 2, 1, 1)) * q
    d = _f16(bp, mr)
    mins = _f16(bp + 2, mr) * mn.to(tl.float32) - (8.0 * d) * sc.to(tl.float32)
    return tl.reshape(ints.to(tl.float32), (BN, 256)), d, mins


@triton.jit
def q4_k_integer_block(bp, b, mr, BN: tl.constexpr):
    """Block b (0..7: 32 values) of the Q4_K superblocks at bp [BN, 1] in q4_k_integer_rows' form,
    straight from the bytes: I [BN, 32] float32 (scale * (quant - 8)) and M [BN, 1] (dmin * min - 8 *
    d * scale); mr [BN, 1] the rows that exist. The quants are the low (even b) or high nibbles of the
    32 bytes of group b // 2, read as eight int32 words."""
    sc, mn = _k_scale_min(bp + 4, b, mr)  # [BN, 1]
    w4 = tl.arange(0, 8)[None, :, None]
    byte = tl.arange(0, 4)[None, None, :]
    wp = (bp + 16 + (b // 2) * 32).to(tl.pointer_type(tl.int32))[:, :, None] + w4  # [BN, 8, 1], as _q4_k_rows
    word = tl.load(wp, mask=mr[:, :, None], other=0)
    q = ((word >> (byte * 8 + (b % 2) * 4)) & 0xF) - 8  # [BN, 8, 4]: value 4 * word + byte
    mins = _f16(bp + 2, mr) * mn.to(tl.float32) - (8.0 * _f16(bp, mr)) * sc.to(tl.float32)
    return (tl.reshape(q, (BN, 32)) * sc).to(tl.float32), mins


# ---- the i-quants and ternary quants: weights/quant_iq.py's arithmetic, its tables read through `tab` ----
@triton.jit
def _u16(p, m):
    """A 16-bit field as int32: the i-quant blocks keep 2-byte alignment, so it loads whole."""
    return tl.load(p.to(tl.pointer_type(tl.uint16)), mask=m, other=0).to(tl.int32)


@triton.jit
def _half_scale(d, code, step: tl.constexpr):
    """quant_iq._half_scales: d * (0.5 + code) * step, in its order (IQ2_*, IQ3_XXS)."""
    return (d * (0.5 + code.to(tl.float32))) * step


@triton.jit
def _iq1_m_d(bp, m):
    """IQ1_M's f16 block scale, the top nibbles of its four uint16 scale words at bp + 48."""
    d_bits = ((_u16(bp + 48, m) >> 12) | ((_u16(bp + 50, m) >> 8) & 0xF0) | ((_u16(bp + 52, m) >> 4) & 0xF00)
              | (_u16(bp + 54, m) & 0xF000))
    return d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _iq4_xs_scale(bp, g, m):
    """IQ4_XS's scale of 32-value group g: d times a 6-bit code (low nibble, 2 high bits) - 32."""
    high = (_u16(bp + 2, m) >> (2 * g)) & 3
    low = (_u8(bp + 4 + g // 2, m) >> ((g % 2) * 4)) & 15
    return _f16(bp, m) * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _tab(tab, i, m):
    return tl.load(tab + i, mask=m, other=0.0)


@triton.jit
def _entries(tab, at: tl.constexpr, index, me, W: tl.constexpr):
    """Entries `index` [BN, E] of a packed grid of W = 8 or 4 values (quant_iq._packed) at word
    `at` of the table: [BN, E, W] exact float32, one 64- or 32-bit load an entry, its bytes
    sign-extended."""
    if W == 8:
        word = tl.load((tab + at).to(tl.pointer_type(tl.int64)) + index, mask=me, other=0)
    else:
        word = tl.load((tab + at).to(tl.pointer_type(tl.int32)) + index, mask=me, other=0).to(tl.int64)
    byte = (word[:, :, None] >> (tl.arange(0, W)[None, None, :].to(tl.int64) * 8)) & 0xFF
    return ((byte ^ 0x80) - 0x80).to(tl.float32)


@triton.jit
def _signs(sbits, first: tl.constexpr, W: tl.constexpr):
    """Factors 1 - 2 * bit for bits first .. first+W-1 of each of sbits [BN, E]: [BN, E, W]."""
    return 1.0 - 2.0 * ((sbits[:, :, None] >> (first + tl.arange(0, W)[None, None, :])) & 1).to(tl.float32)


@triton.jit
def _ksigns(tab, index, me):
    """ggml's ksigns byte (8 sign bits) of 7-bit indices [BN, E]."""
    return tl.load((tab + TAB_KSIGNS_U8).to(tl.pointer_type(tl.uint8)) + index, mask=me, other=0).to(tl.int32)


@triton.jit
def _row_mask(m, BN: tl.constexpr):
    """A superblock type's [BN, 1] row mask from the values' [BN, 256] (a row ends at a chunk)."""
    return tl.reshape(tl.max(m.to(tl.int32), axis=1), (BN, 1)) > 0


@triton.jit
def _nibble(p, i, m):
    """Nibble i (low first) of the bytes at p."""
    return (_u8(p + i // 2, m) >> ((i % 2) * 4)) & 15


# The i-quants per grid entry (8 or 4 values), not per value: an entry's index, grid word and
# signs are loaded once for all its values, a group's scale once for its entries. quant_iq's
# arithmetic in its order, so the values are its bits. The 16- and 32-bit fields load as bytes or
# 16-bit halves: these blocks keep only 2-byte alignment.
@triton.jit
def _iq2_xxs_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, then per 32 values 4 index bytes and a word of 4 x 7 sign bits and a 4-bit scale."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 66
    e = tl.arange(0, 32)[None, :]  # grid entries: group e // 4
    gp = bp + 2 + 8 * (e // 4)
    aux = _u16(gp + 4, mr) | (_u16(gp + 6, mr) << 16)
    db = _half_scale(_f16(bp, mr), (aux >> 28) & 15, 0.25)
    sign = _signs(_ksigns(tab, (aux >> (7 * (e % 4))) & 127, mr), 0, 8)
    grid = _entries(tab, TAB_IQ2XXS_I8, _u8(gp + e % 4, mr), mr, 8)
    return tl.reshape(db[:, :, None] * grid * sign, (BN, 256))


@triton.jit
def _iq2_xs_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, 32 uint16 (a 9-bit index, 7 sign bits), 16 4-bit scales."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 74
    e = tl.arange(0, 32)[None, :]
    q = _u16(bp + 2 + 2 * e, mr)
    db = _half_scale(_f16(bp, mr), _nibble(bp + 66, e // 2, mr), 0.25)
    grid = _entries(tab, TAB_IQ2XS_I8, q & 511, mr, 8)
    return tl.reshape(db[:, :, None] * grid * _signs(_ksigns(tab, q >> 9, mr), 0, 8), (BN, 256))


@triton.jit
def _iq2_s_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, 32 index bytes, 32 sign bytes, 2 high index bits each in qh, 16 4-bit scales."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 82
    e = tl.arange(0, 32)[None, :]
    index = _u8(bp + 2 + e, mr) | (((_u8(bp + 66 + e // 4, mr) >> ((e % 4) * 2)) & 3) << 8)
    db = _half_scale(_f16(bp, mr), _nibble(bp + 74, e // 2, mr), 0.25)
    grid = _entries(tab, TAB_IQ2S_I8, index, mr, 8)
    return tl.reshape(db[:, :, None] * grid * _signs(_u8(bp + 34 + e, mr), 0, 8), (BN, 256))


@triton.jit
def _iq3_xxs_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, 64 index bytes (4-value entries), per 32 values a word of 4 x 7 sign bits and a scale."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 98
    e = tl.arange(0, 64)[None, :]  # group e // 8; its 8 sign bits for entries e and e ^ 1
    ap = bp + 66 + 4 * (e // 8)
    aux = _u16(ap, mr) | (_u16(ap + 2, mr) << 16)
    db = _half_scale(_f16(bp, mr), (aux >> 28) & 15, 0.5)
    sbits = _ksigns(tab, (aux >> (7 * ((e % 8) // 2))) & 127, mr)
    grid = _entries(tab, TAB_IQ3XXS_I8, _u8(bp + 2 + e, mr), mr, 4)
    sign = tl.where((e % 2 == 0)[:, :, None], _signs(sbits, 0, 4), _signs(sbits, 4, 4))
    return tl.reshape(db[:, :, None] * grid * sign, (BN, 256))


@triton.jit
def _iq3_s_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, 64 index bytes (4-value entries), a 9th index bit each in qh, 32 sign bytes, 8 4-bit scales."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 110
    e = tl.arange(0, 64)[None, :]
    index = _u8(bp + 2 + e, mr) | (((_u8(bp + 66 + e // 8, mr) >> (e % 8)) & 1) << 8)
    db = _f16(bp, mr) * (1 + 2 * _nibble(bp + 106, e // 8, mr)).to(tl.float32)
    sbits = _u8(bp + 74 + e // 2, mr)
    sign = tl.where((e % 2 == 0)[:, :, None], _signs(sbits, 0, 4), _signs(sbits, 4, 4))
    grid = _entries(tab, TAB_IQ3S_I8, index, mr, 4)
    return tl.reshape(db[:, :, None] * grid * sign, (BN, 256))


@triton.jit
def _iq1_s_rows(rowp, c, m, BN: tl.constexpr, tab):
    """d, 32 index bytes, per 32 values a uint16: 4 x 3 high index bits, a 3-bit scale, the delta's sign."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 50
    e = tl.arange(0, 32)[None, :]
    qh = _u16(bp + 34 + 2 * (e // 4), mr)
    dl = _f16(bp, mr) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    delta = tl.where((qh & 0x8000) != 0, -IQ1_DELTA_C, IQ1_DELTA_C)
    index = _u8(bp + 2 + e, mr) | (((qh >> (3 * (e % 4))) & 7) << 8)
    grid = _entries(tab, TAB_IQ1S_I8, index, mr, 8)
    return tl.reshape(dl[:, :, None] * (grid + delta[:, :, None]), (BN, 256))


@triton.jit
def _iq1_m_rows(rowp, c, m, BN: tl.constexpr, tab):
    """32 index bytes, per entry a nibble (3 high index bits, the delta's sign), 4 uint16 of 3-bit
    scales whose top nibbles hold d."""
    mr = _row_mask(m, BN)
    bp = rowp + c * 56
    d = _iq1_m_d(bp, mr)  # [BN, 1]
    e = tl.arange(0, 32)[None, :]
    s = e // 2  # a scale per 16 values
    dl = d * (2 * ((_u16(bp + 48 + 2 * (s // 4), mr) >> (3 * (s % 4))) & 7) + 1).to(tl.float32)
    half = _nibble(bp + 32, e, mr)
    delta = tl.where((half & 8) != 0, -IQ1_DELTA_C, IQ1_DELTA_C)
    grid = _entries(tab, TAB_IQ1S_I8, _u8(bp + e, mr) | ((half & 7) << 8), mr, 8)
    return tl.reshape(dl[:, :, None] * (grid + delta[:, :, None]), (BN, 256))


@triton.jit
def _iq4_nl(bp, jj, m, tab):  # d, qs[16]: Q4_0's nibbles, through a table
    return _f16(bp, m) * _tab(tab, TAB_IQ4NL + _nibble32(bp + 2, jj, m), m)


@triton.jit
def _iq4_xs(bp, j, m, tab):  # d, scales_h uint16, scales_l[4], qs[128]
    g = j // 32
    return _iq4_xs_scale(bp, g, m) * _tab(tab, TAB_IQ4NL + _nibble32(bp + 8 + 16 * g, j % 32, m), m)


@triton.jit
def _tq1_0(bp, j, m):  # qs[48] (five trits a byte), qh[4] (four), d
    at = tl.where(j < 160, j % 32, tl.where(j < 240, 32 + (j - 160) % 16, 48 + (j - 240) % 4))
    power = tl.where(j < 160, j // 32, tl.where(j < 240, (j - 160) // 16, (j - 240) // 4))
    p3 = tl.where(power == 0, 1, tl.where(power == 1, 3, tl.where(power == 2, 9, tl.where(power == 3, 27, 81))))
    trit = (((_u8(bp + at, m) * p3) & 255) * 3) >> 8
    return _f16(bp + 52, m) * (trit - 1).to(tl.float32)


@triton.jit
def _tq2_0(bp, j, m):  # qs[64] (four 2-bit values a byte), d
    q = (_u8(bp + 32 * (j // 128) + j % 32, m) >> (2 * ((j % 128) // 32))) & 3
    return _f16(bp + 64, m) * (q - 1).to(tl.float32)


@triton.jit
def chunk(QT: tl.constexpr, rowp, c, j, m, tab):
    """Values [BN, 256] of chunk c of the rows at rowp (uint8 pointers [BN, 1]); j [1, 256]; `tab`
    the i-quants' tables (weights.quant_iq.kernel_tables), unused by the other types."""
    if QT == F32:
        w = tl.load((rowp + (c * 256 + j) * 4).to(tl.pointer_type(tl.float32)), mask=m, other=0)
    elif QT == F16:
        w = tl.load((rowp + (c * 256 + j) * 2).to(tl.pointer_type(tl.float16)), mask=m, other=0).to(tl.float32)
    elif QT == BF16:
        w = tl.load((rowp + (c * 256 + j) * 2).to(tl.pointer_type(tl.bfloat16)), mask=m, other=0).to(tl.float32)
    elif QT == Q4_0:
        w = _q4_0(rowp + (c * 8 + j // 32) * 18, j % 32, m)
    elif QT == Q4_1:
        w = _q4_1(rowp + (c * 8 + j // 32) * 20, j % 32, m)
    elif QT == Q5_0:
        w = _q5_0(rowp + (c * 8 + j // 32) * 22, j % 32, m)
    elif QT == Q5_1:
        w = _q5_1(rowp + (c * 8 + j // 32) * 24, j % 32, m)
    elif QT == Q8_0:
        w = _q8_0_rows(rowp, c, m, rowp.shape[0])
    elif QT == Q8_0R:
        w = _q8_0r_rows(rowp, c, m, rowp.shape[0])
    elif QT == MXFP4:
        w = _mxfp4_rows(rowp, c, m, rowp.shape[0])
    elif QT == Q2_K:
        w = _q2_k(rowp + c * 84, j, m)
    elif QT == Q3_K:
        w = _q3_k(rowp + c * 110, j, m)
    elif QT == Q4_K:
        w = _q4_k_rows(rowp, c, m, rowp.shape[0])
    elif QT == Q5_K:
        w = _q5_k(rowp + c * 176, j, m)
    elif QT == IQ2_XXS:
        w = _iq2_xxs_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ2_XS:
        w = _iq2_xs_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ2_S:
        w = _iq2_s_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ3_XXS:
        w = _iq3_xxs_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ3_S:
        w = _iq3_s_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ1_S:
        w = _iq1_s_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ1_M:
        w = _iq1_m_rows(rowp, c, m, rowp.shape[0], tab)
    elif QT == IQ4_NL:
        w = _iq4_nl(rowp + (c * 8 + j // 32) * 18, j % 32, m, tab)
    elif QT == IQ4_XS:
        w = _iq4_xs(rowp + c * 136, j, m, tab)
    elif QT == TQ1_0:
        w = _tq1_0(rowp + c * 54, j, m)
    elif QT == TQ2_0:
        w = _tq2_0(rowp + c * 66, j, m)
    else:
        tl.static_assert(QT == Q6_K, "unsupported ggml type")
        w = _q6_k(rowp + c * 210, j, m)
    return tl.where(m, w, 0.0)



@triton.jit
def block_dot(QT: tl.constexpr, rowp, c, nmask, K, xv):
    """The decode kernels' chunk products for the types that sum a block before scaling it (MXFP4,
    Q8_0); the others' chunk() values are summed by the kernels themselves: wrapped in a
    function like this one, ptxas gave the Q4_K kernels up to a third more registers."""
    if QT == MXFP4:
        s = mxfp4_dot(rowp, c, nmask, K, xv)
    else:
        tl.static_assert(QT == Q8_0, "no block_dot for this type")
        s = q8_0_dot(rowp, c, nmask, K, xv)
    return s
