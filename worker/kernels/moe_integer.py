"""A prompt's Q4_K experts as grouped products of their integers: moe_dense's shape (the pairs sorted
by expert, each selected expert unpacked once, tiles of one expert's pairs on tensor cores), with
what is unpacked and multiplied changed so that the products are exact in float16.

A Q4_K value is d * (scale * quant) - dmin * min: d and dmin per row and superblock of 256, scale
and min per block of 32, so I = scale * (quant - 8) is an integer in [-504, 441], exact in float16, and

    W[n] . x = sum over superblocks S of d[n, S] * (I[n, S] . x[S])  -  sum over blocks b of M[n, b] * xs[b]

with M = dmin * min - 8 * d * scale and xs[b] the sum of x over block b (the quants centred, so that
I . x stays small where x is away from zero: dequant_tl.q4_k_integer_rows). Each activation row is scaled by a power
of two (max |x| in [2^14, 2^15), inside float16's range) and split into two float16 parts, hi + lo
(xs summed from them, in those units):
every product of a part and an integer is exact and summed in float32 on the tensor cores, which
keeps 22 bits of each activation (as tf32x3 does) in two float16 passes where moe_dense takes three
TF32 passes (each half float16's rate); the superblock sums are scaled by d in float32 and the
block sums of x meet M in one tf32x3 product. The unpacked integers take 2 bytes a value where
moe_dense's float32 copy takes 4: half the scratch traffic, which bound moe_dense at a few
hundred tokens.

A pair's row is computed from its own row (its scale and parts) by a tile of fixed shape over K in
a fixed order, whichever other pairs share the tile, so a cache loading a step's experts in waves
gives the resident table's bits, as moe_dense. Experts with biases, or any matrix not Q4_K, run in
moe_dense (`runs`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from ..nn.activation import Activation
from ..weights.expert_roles import ExpertRoles, MatrixRole
from .dequant_tl import _f16, q4_k_integer_block, q4_k_integer_rows
from .expert_tiles import expert_tiles, tile_at
from .moe_dense import scratch_values
from .moe_tl import _act

Q4_K = int(GGMLQuantizationType.Q4_K)
SUPER, BLOCK = 256, 32  # a superblock (one d) and a block (one min) of K
BN_UNPACK = 16  # rows per unpacking program
BM, BN, BK = 64, 128, 32  # a product's tile: pairs of one expert x rows of its matrix x the K step
WARPS, STAGES = 8, 3  # 4 warps spilled 0.9-4.6 KB a program (bench/kernel_registers.py)
BM_TILES, BN_TILES, WARPS_TILES = 16, 64, 4  # experts_integer_tiles: a few pairs of one expert x rows of a matrix


def runs(roles: ExpertRoles) -> bool:
    """Whether these experts run here: every matrix Q4_K, no biases."""
    return (all(int(r.ggml_type) == Q4_K for r in (roles.gate, roles.up, roles.down))
            and roles.gate_bias is None and roles.up_bias is None and roles.down_bias is None)


@triton.jit
def _unpack_kernel(pool_ptr, block_ptr, n_ptr, first, ints_ptr, d_ptr, m_ptr, role_off, N, row_bytes,
                   ints_stride, d_stride, m_stride, KS: tl.constexpr, BN: tl.constexpr):
    """For the experts of ranks first + e below n[0]: ints[e, n, k] = scale * quant, d[e, n, S],
    m[e, n, b] = dmin * min of the role's Q4_K matrix (rows of KS superblocks); grid (N/BN, KS,
    experts of the group)."""
    pid_n, c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if first + e >= tl.load(n_ptr):
        return
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + first + e), 16) + role_off
    j = tl.arange(0, 256)
    ints, d, mins = q4_k_integer_rows(base + n.to(tl.int64)[:, None] * row_bytes, c, nm[:, None] & (j[None, :] >= 0), BN)
    row = n.to(tl.int64)[:, None]
    tl.store(ints_ptr + e.to(tl.int64) * ints_stride + row * (KS * 256) + c * 256 + j[None, :], ints.to(tl.float16),
             mask=nm[:, None])
    tl.store(d_ptr + e.to(tl.int64) * d_stride + row * KS + c, d, mask=nm[:, None])
    b = tl.arange(0, 8)[None, :]
    tl.store(m_ptr + e.to(tl.int64) * m_stride + row * (KS * 8) + c * 8 + b, mins, mask=nm[:, None])


@triton.jit
def _split_rows_kernel(src_ptr, F, hi_ptr, lo_ptr, sums_ptr, inv_ptr, K, limit, alpha, beta, linear_beta,
                       GATED: tl.constexpr, ACT: tl.constexpr, BK: tl.constexpr):
    """Row r of the activations (x = src[r] [K]; GATED: act(gate, up) of gu's row [2F], K = F) as
    hi + lo = x * 2^e (float16 each), its block sums [K / 32] (of x, float32) and 2^-e; grid (rows,)."""
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BK)
    km = k < K
    if GATED:
        g = tl.load(src_ptr + r * 2 * F + k, mask=km, other=0.0)
        u = tl.load(src_ptr + r * 2 * F + F + k, mask=km, other=0.0)
        x = tl.where(km, _act(g, u, limit, alpha, beta, linear_beta, ACT), 0.0)
    else:
        x = tl.load(src_ptr + r * K + k, mask=km, other=0.0)
    top = tl.max(tl.abs(x), 0)
    # 2^e with top * 2^e in [2^14, 2^15): from top's exponent field (1 for a row of zeros)
    exp = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # 2^shift and 2^-shift both normal floats, built from their bits: no division (the GPU's flushes
    # a subnormal quotient to zero)
    shift = tl.minimum(tl.maximum(tl.where(top > 0, 14 - exp, 0), -126), 126)
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    xs = x * scale
    hi = xs.to(tl.float16)
    lo = (xs - hi.to(tl.float32)).to(tl.float16)
    tl.store(hi_ptr + r * K + k, hi, mask=km)
    tl.store(lo_ptr + r * K + k, lo, mask=km)
    nb = K // 32
    # the block sums of the parts the products read, in their scaled units: the mins' term meets the
    # same rounded x as the integers' (sums of unscaled x made the two terms' cancellation worse)
    sums = tl.sum(tl.reshape(hi.to(tl.float32) + lo.to(tl.float32), (BK // 32, 32)), 1)
    b = tl.arange(0, BK // 32)
    tl.store(sums_ptr + r * nb + b, sums, mask=b < nb)
    tl.store(inv_ptr + r, ((127 - shift) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _product_kernel(hi_ptr, lo_ptr, sums_ptr, inv_ptr, src_ptr, ints_ptr, d_ptr, m_ptr, tiles_ptr, first, experts,
                    out_ptr, pair_ptr, wt_ptr, N, K, ints_stride, d_stride, m_stride, out_width,
                    GATHER: tl.constexpr, SCATTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """y[r, n] = W_e[n] . x[row r] for the sorted pair rows r of a tile of expert e, in the integer
    form (module docstring); x's row is src[r] (GATHER: the pair's token) or r. SCATTER: out[pair[r],
    n] = weight[pair[r]] * y, else out[r, n] = y; grid (tiles, N/BN)."""
    _, e, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), first, experts, BM)
    if elsewhere:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    if GATHER:
        row = tl.load(src_ptr + r, mask=rm, other=0)
    else:
        row = r
    e64 = e.to(tl.int64)
    inv = tl.load(inv_ptr + row, mask=rm, other=1.0)
    # the mins' term first (the block sums are in the scaled rows' units), so that it shares their accumulator
    nb = K // 32
    acc = tl.zeros([BM, BN], tl.float32)
    for b0 in range(0, nb, 32):
        bb = b0 + tl.arange(0, 32)
        bm = bb < nb
        xs = tl.load(sums_ptr + row[:, None] * nb + bb[None, :], mask=rm[:, None] & bm[None, :], other=0.0)
        mm = tl.load(m_ptr + e64 * m_stride + (n[None, :] * nb + bb[:, None]), mask=bm[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(xs, mm, acc, input_precision="tf32x3")
    acc = -acc
    w = ints_ptr + e64 * ints_stride
    wn = n[None, :] * K
    ks = K // 256
    for s in range(0, ks):
        part = tl.zeros([BM, BN], tl.float32)
        for kk in range(0, 256, BK):
            k = s * 256 + kk + tl.arange(0, BK)
            hi = tl.load(hi_ptr + row[:, None] * K + k[None, :], mask=rm[:, None], other=0.0)
            lo = tl.load(lo_ptr + row[:, None] * K + k[None, :], mask=rm[:, None], other=0.0)
            b = tl.load(w + (wn + k[:, None]), mask=nm[None, :], other=0.0)
            step = tl.dot(lo, b, tl.zeros([BM, BN], tl.float32))
            part += tl.dot(hi, b, step)  # from zero, then added in float32: the tensor cores truncate their sums
        d = tl.load(d_ptr + e64 * d_stride + (n * ks + s), mask=nm, other=0.0)
        acc += part * d[None, :]
    acc = acc * inv[:, None]
    if SCATTER:
        pair = tl.load(pair_ptr + r, mask=rm, other=0)
        acc = acc * tl.load(wt_ptr + pair, mask=rm, other=0.0)[:, None]
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * out_width + n[None, :], acc, mask=rm[:, None] & nm[None, :])
    else:
        tl.store(out_ptr + r.to(tl.int64)[:, None] * out_width + n[None, :], acc, mask=rm[:, None] & nm[None, :])


@triton.jit
def _tile_kernel(hi_ptr, lo_ptr, sums_ptr, inv_ptr, src_ptr, pool_ptr, block_ptr, tiles_ptr, experts, out_ptr, pair_ptr,
                 wt_ptr, role_off, role2_off, row_bytes, N1, N, K, out_width, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    """_product_kernel with the integers decoded from the expert's Q4_K bytes as each block of K is
    reached, nothing unpacked beforehand: rows n < N1 of the role at role_off, the rest of the one at
    role2_off (gate's rows, then up's; BN divides N1); the mins' term taken per block of 32 as a
    float32 outer product; grid (tiles, N/BN)."""
    rank, _, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), 0, experts, BM)
    if elsewhere:
        return
    n0 = tl.program_id(1) * BN
    n = n0 + tl.arange(0, BN)
    nm = n < N
    mr = nm[:, None]
    first_role = n0 < N1
    nr = tl.where(first_role, n, n - N1)
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16) + tl.where(first_role, role_off, role2_off)
    rowp = base + nr.to(tl.int64)[:, None] * row_bytes  # [BN, 1]
    if GATHER:
        row = tl.load(src_ptr + r, mask=rm, other=0)
    else:
        row = r
    inv = tl.load(inv_ptr + row, mask=rm, other=1.0)
    nb = K // 32
    acc = tl.zeros([BM, BN], tl.float32)
    for s in range(0, K // 256):
        bp = rowp + s * 144
        part = tl.zeros([BM, BN], tl.float32)
        for b in range(0, 8):
            ints, mins = q4_k_integer_block(bp, b, mr, BN)
            w = tl.trans(ints.to(tl.float16))  # [32, BN]
            k = s * 256 + b * 32 + tl.arange(0, 32)
            hi = tl.load(hi_ptr + row[:, None] * K + k[None, :], mask=rm[:, None], other=0.0)
            lo = tl.load(lo_ptr + row[:, None] * K + k[None, :], mask=rm[:, None], other=0.0)
            step = tl.dot(lo, w, tl.zeros([BM, BN], tl.float32))
            part += tl.dot(hi, w, step)
            xs = tl.load(sums_ptr + row * nb + s * 8 + b, mask=rm, other=0.0)
            acc -= xs[:, None] * tl.reshape(mins, (1, BN))
        acc += part * tl.reshape(_f16(bp, mr), (1, BN))
    acc = acc * inv[:, None]
    if SCATTER:
        pair = tl.load(pair_ptr + r, mask=rm, other=0)
        acc = acc * tl.load(wt_ptr + pair, mask=rm, other=0.0)[:, None]
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * out_width + n[None, :], acc, mask=rm[:, None] & nm[None, :])
    else:
        tl.store(out_ptr + r.to(tl.int64)[:, None] * out_width + n[None, :], acc, mask=rm[:, None] & nm[None, :])


class _Unpacked:
    """A group's experts in integer form, one matrix: ints [E, N, K] float16, d [E, N, K/256], m [E, N, K/32]."""

    def __init__(self, experts: int, n: int, k: int, dev: torch.device) -> None:
        self.ints = torch.empty((experts, n, k), dtype=torch.float16, device=dev)
        self.d = torch.empty((experts, n, k // SUPER), dtype=torch.float32, device=dev)
        self.m = torch.empty((experts, n, k // BLOCK), dtype=torch.float32, device=dev)

    def fill(self, rows: slice, pool: torch.Tensor, blocks: torch.Tensor, n_experts: torch.Tensor, first: int,
             role: MatrixRole) -> None:
        ints, d, m = self.ints[:, rows], self.d[:, rows], self.m[:, rows]
        grid = (triton.cdiv(role.n, BN_UNPACK), role.k // SUPER, ints.shape[0])
        _unpack_kernel[grid](pool, blocks, n_experts, first, ints, d, m, role.offset, role.n, role.row_bytes,
                             ints.stride(0), d.stride(0), m.stride(0), KS=role.k // SUPER, BN=BN_UNPACK, num_warps=4)


def unpacked_bytes(roles: ExpertRoles) -> int:
    """Scratch bytes one expert takes unpacked (all three matrices)."""
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    values = 2 * f * k + d * f
    return values * 2 + values // SUPER * 4 + values // BLOCK * 4


class _Parts:
    """Activation rows split for the products: hi, lo [R, K] float16, sums [R, K/32], inv [R]."""

    def __init__(self, rows: int, k: int, dev: torch.device) -> None:
        self.hi = torch.empty((rows, k), dtype=torch.float16, device=dev)
        self.lo = torch.empty((rows, k), dtype=torch.float16, device=dev)
        self.sums = torch.empty((rows, k // BLOCK), dtype=torch.float32, device=dev)
        self.inv = torch.empty(rows, dtype=torch.float32, device=dev)

    def split(self, src: torch.Tensor, act: Activation | None = None) -> "_Parts":
        k = self.hi.shape[1]
        _split_rows_kernel[(self.hi.shape[0],)](
            src, k, self.hi, self.lo, self.sums, self.inv, k,
            act.limit if act else 0.0, act.alpha if act else 0.0, act.beta if act else 0.0,
            act.linear_beta if act else 0.0, GATED=act is not None, ACT=int(act.kind) if act else 0,
            BK=triton.next_power_of_2(k), num_warps=4)
        return self


def experts_integer(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                    roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, n_expert: int | None = None) -> torch.Tensor:
    """As moe_dense.experts_dense, for experts where `runs(roles)`: x [T, K] float32, offsets [T*k]
    int64 (bytes into pool), weights [T*k] -> out [T*k, D]; rows of pairs outside `pairs` left as
    they were. No host sync."""
    total = offsets.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    dev = x.device
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=dev)
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, BM, n_expert)
    rows = t.order.shape[0]
    if max(rows, x.shape[0]) * max(2 * f, k) >= 1 << 31 or max(2 * f * k, d * f) >= 1 << 31:
        raise ValueError(f"{rows} pairs of experts {d}x{f}: past the int32 offsets of moe_integer's products")
    xp = _Parts(x.shape[0], k, dev).split(x.contiguous())
    gu = torch.zeros((rows, 2 * f), dtype=torch.float32, device=dev)
    hp = _Parts(rows, f, dev)
    per_group = max(1, min(t.max_experts, scratch_values(dev) * 4 // unpacked_bytes(roles)))
    w_gu = _Unpacked(per_group, 2 * f, k, dev)
    w_down = _Unpacked(per_group, d, f, dev)
    n_tiles = t.table.shape[0]
    for first in range(0, t.max_experts, per_group):
        w_gu.fill(slice(0, f), pool, t.blocks, t.n_experts, first, roles.gate)
        w_gu.fill(slice(f, 2 * f), pool, t.blocks, t.n_experts, first, roles.up)
        w_down.fill(slice(0, d), pool, t.blocks, t.n_experts, first, roles.down)
        _product_kernel[(n_tiles, triton.cdiv(2 * f, BN))](
            xp.hi, xp.lo, xp.sums, xp.inv, t.tokens, w_gu.ints, w_gu.d, w_gu.m, t.table, first, per_group,
            gu, t.order, weights, 2 * f, k, w_gu.ints.stride(0), w_gu.d.stride(0), w_gu.m.stride(0), 2 * f,
            GATHER=True, SCATTER=False, BM=BM, BN=BN, BK=BK, num_warps=WARPS, num_stages=STAGES)
        hp.split(gu, act)
        _product_kernel[(n_tiles, triton.cdiv(d, BN))](
            hp.hi, hp.lo, hp.sums, hp.inv, t.tokens, w_down.ints, w_down.d, w_down.m, t.table, first, per_group,
            out, t.order, weights, d, f, w_down.ints.stride(0), w_down.d.stride(0), w_down.m.stride(0), d,
            GATHER=False, SCATTER=True, BM=BM, BN=BN, BK=BK, num_warps=WARPS, num_stages=STAGES)
    return out


def experts_integer_tiles(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                          roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                          out: torch.Tensor | None = None, n_expert: int | None = None) -> torch.Tensor:
    """experts_integer for a few pairs an expert (a short prompt, a batched decode step): tiles of up
    to BM_TILES pairs of one expert, each block of its Q4_K bytes decoded once for the tile and met
    on tensor cores, no scratch. Same arguments and contract."""
    total = offsets.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    dev = x.device
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=dev)
    if f % BN_TILES:  # a program's rows are all gate's or all up's (Q4_K rows: multiples of 256)
        raise ValueError(f"experts of {f} rows: moe_integer's tiles take multiples of {BN_TILES}")
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, BM_TILES, n_expert)
    rows = t.order.shape[0]
    if max(rows, x.shape[0]) * max(2 * f, k) >= 1 << 31:
        raise ValueError(f"{rows} pairs of experts {d}x{f}: past the int32 offsets of moe_integer's products")
    xp = _Parts(x.shape[0], k, dev).split(x.contiguous())
    gu = torch.zeros((rows, 2 * f), dtype=torch.float32, device=dev)
    n_tiles = t.table.shape[0]
    _tile_kernel[(n_tiles, triton.cdiv(2 * f, BN_TILES))](
        xp.hi, xp.lo, xp.sums, xp.inv, t.tokens, pool, t.blocks, t.table, t.max_experts, gu, t.order, weights,
        roles.gate.offset, roles.up.offset, roles.gate.row_bytes, f, 2 * f, k, 2 * f,
        GATHER=True, SCATTER=False, BM=BM_TILES, BN=BN_TILES, num_warps=WARPS_TILES)
    hp = _Parts(rows, f, dev).split(gu, act)
    _tile_kernel[(n_tiles, triton.cdiv(d, BN_TILES))](
        hp.hi, hp.lo, hp.sums, hp.inv, t.tokens, pool, t.blocks, t.table, t.max_experts, out, t.order, weights,
        roles.down.offset, roles.down.offset, roles.down.row_bytes, d, d, f, d,
        GATHER=False, SCATTER=True, BM=BM_TILES, BN=BN_TILES, num_warps=WARPS_TILES)
    return out
