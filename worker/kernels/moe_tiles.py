"""A short prompt's experts in tiles of one expert's pairs: the step's pairs sorted by expert
(expert_tiles.py), and each chunk of an expert's rows decoded from its GGUF bytes once for up to G
of its pairs, where moe_tl decodes it again for every pair. For the steps between a decode step
(one token: moe_tl, split over K, in the CUDA graph) and a long prompt (moe_dense, which pays once
an expert has many pairs): a prompt of tens of tokens gives most selected experts two to four pairs.

Each pair's sums are its own: a chunk's products for pair g are reduced to one value per row and
added to g's accumulator in chunk order, whichever pairs share the tile, so a cache that loads a
step's experts in waves gives the very bits of the resident table. Two launches, as moe_tl: gate
and up, then the activation, the down projection, its bias and the routing weight; Q4_K experts
without biases take kernels of their own in three (gate and up, the activation once a pair, down),
which also run a batched decode step of one pair an expert or more (moe.fused_path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nn.activation import Activation
from ..weights.expert_roles import ExpertRoles
from ..weights.quant_iq import kernel_tables
from .dequant_tl import CHUNK, _q4_k_rows, chunk
from .expert_tiles import expert_tiles
from .moe_integer import runs as integer_runs
from .moe_tl import ACT_BLOCK, _act, _act_kernel

G = 4  # pairs of one expert per tile
BN = 16  # rows of an expert's matrix per program
WARPS = 4
# The Q4_K kernels' pairs a tile: 2 where the step has under 3 pairs an expert (a batched decode step,
# a prompt of a few tens of tokens), else 4. H100, resident Q3-12L: a 16-row step 10.65 ms with 2,
# 11.92 with 4; a 64-token prompt 4,501 tok/s with 4, 3,884 with 8.
G_Q4_K_FEW, G_Q4_K = 2, 4
SUPERBLOCK = tl.constexpr(256)


@triton.jit
def _tile_rows(table_ptr, t):
    """Tile t: its expert's rank and its sorted rows r0 .. r1-1 (r1 <= r0: an unused tile)."""
    return tl.load(table_ptr + 3 * t), tl.load(table_ptr + 3 * t + 1), tl.load(table_ptr + 3 * t + 2)


@triton.jit
def _gate_up_kernel(x_ptr, tok_ptr, pool_ptr, block_ptr, table_ptr, gu_ptr, tab, gate_off, up_off, gate_rb, up_rb, F, K,
                    QG: tl.constexpr, QU: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """gu[r, 0, n] = gate[n] . x[tok[r]] and gu[r, 1, n] = up[n] . x[tok[r]] for the sorted rows r
    of a tile; grid (tiles, F/BN)."""
    rank, r0, r1 = _tile_rows(table_ptr, tl.program_id(0))
    if r1 <= r0:
        return
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    gi = tl.arange(0, G)[:, None]
    rows = n.to(tl.int64)[:, None]
    grow = base + gate_off + rows * gate_rb
    urow = base + up_off + rows * up_rb
    acc_g = tl.zeros([G, BN], tl.float32)
    acc_u = tl.zeros([G, BN], tl.float32)
    for c in range(0, tl.cdiv(K, CH)):
        k = c * CH + j
        m = (n < F)[:, None] & (k < K)[None, :]
        wg = chunk(QG, grow, c, j[None, :], m, tab)
        wu = chunk(QU, urow, c, j[None, :], m, tab)
        for g in tl.static_range(G):
            here = r0 + g < r1
            tok = tl.load(tok_ptr + r0 + g, mask=here, other=0).to(tl.int64)
            xv = tl.load(x_ptr + tok * K + k, mask=(k < K) & here, other=0.0)[None, :]
            acc_g += tl.where(gi == g, tl.sum(wg * xv, axis=1)[None, :], 0.0)
            acc_u += tl.where(gi == g, tl.sum(wu * xv, axis=1)[None, :], 0.0)
    r = r0 + tl.arange(0, G)
    keep = (r < r1)[:, None] & (n < F)[None, :]
    out = gu_ptr + r.to(tl.int64)[:, None] * (2 * F) + n[None, :]
    tl.store(out, acc_g, mask=keep)
    tl.store(out + F, acc_u, mask=keep)


@triton.jit
def _down_kernel(gu_ptr, pool_ptr, block_ptr, table_ptr, order_ptr, w_ptr, y_ptr, tab, gate_b, up_b, down_off, down_rb,
                 down_b, D, F, limit, alpha, beta, linear_beta, QD: tl.constexpr, ACT: tl.constexpr,
                 GU_BIAS: tl.constexpr, DOWN_BIAS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                 CH: tl.constexpr):
    """y[pair[r], n] = weight[pair[r]] * (down[n] . act(gate[r] + bg, up[r] + bu) + bd[n]) for the
    sorted rows r of a tile, the activation applied as each chunk of gu is read; grid (tiles, D/BN)."""
    rank, r0, r1 = _tile_rows(table_ptr, tl.program_id(0))
    if r1 <= r0:
        return
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    gi = tl.arange(0, G)[:, None]
    drow = base + down_off + n.to(tl.int64)[:, None] * down_rb
    acc = tl.zeros([G, BN], tl.float32)
    for c in range(0, tl.cdiv(F, CH)):
        k = c * CH + j
        km = k < F
        wd = chunk(QD, drow, c, j[None, :], (n < D)[:, None] & km[None, :], tab)
        for g in tl.static_range(G):
            here = r0 + g < r1
            row = gu_ptr + (r0 + g).to(tl.int64) * (2 * F)
            gv = tl.load(row + k, mask=km & here, other=0.0)
            uv = tl.load(row + F + k, mask=km & here, other=0.0)
            if GU_BIAS:
                gv += tl.load((base + gate_b).to(tl.pointer_type(tl.float32)) + k, mask=km, other=0.0)
                uv += tl.load((base + up_b).to(tl.pointer_type(tl.float32)) + k, mask=km, other=0.0)
            av = tl.where(km & here, _act(gv, uv, limit, alpha, beta, linear_beta, ACT), 0.0)
            acc += tl.where(gi == g, tl.sum(wd * av[None, :], axis=1)[None, :], 0.0)
    if DOWN_BIAS:
        acc += tl.load((base + down_b).to(tl.pointer_type(tl.float32)) + n, mask=n < D, other=0.0)[None, :]
    r = r0 + tl.arange(0, G)
    rm = r < r1
    pair = tl.load(order_ptr + r, mask=rm, other=0)
    acc = acc * tl.load(w_ptr + pair, mask=rm, other=0.0)[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc, mask=rm[:, None] & (n < D)[None, :])


# Q4_K experts (no biases): each superblock decoded once per tile by _q4_k_rows with a mask per row,
# not per value (a K-quant row ends at a superblock), and the activation computed once a pair by
# moe_tl._act_kernel, not by every program of down for every value: gate+up / down 12.7 / 14.0 SASS
# instructions a value at G = 4 against the general kernels' 15.6 / 22.8 (bench/kernel_registers.py
# --sass), 9.0 / 9.7 at G = 2. Each pair's products are reduced per superblock and added in order, as
# in the general kernels: the same bits (tests/kernels/test_moe_kernels.py).
@triton.jit
def _gate_up_q4_k_kernel(x_ptr, tok_ptr, pool_ptr, block_ptr, table_ptr, gu_ptr, gate_off, up_off, gate_rb, up_rb, F, K,
                         G: tl.constexpr, BN: tl.constexpr):
    """_gate_up_kernel for Q4_K gate and up; grid (tiles, F/BN)."""
    rank, r0, r1 = _tile_rows(table_ptr, tl.program_id(0))
    if r1 <= r0:
        return
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mr = (n < F)[:, None]
    gi = tl.arange(0, G)[:, None]
    rows = n.to(tl.int64)[:, None]
    grow = base + gate_off + rows * gate_rb
    urow = base + up_off + rows * up_rb
    j = tl.arange(0, SUPERBLOCK)
    acc_g = tl.zeros([G, BN], tl.float32)
    acc_u = tl.zeros([G, BN], tl.float32)
    for c in range(0, K // SUPERBLOCK):
        wg = _q4_k_rows(grow, c, mr, BN)  # [BN, 256]; a row mask alone, no mask per value
        wu = _q4_k_rows(urow, c, mr, BN)
        for g in tl.static_range(G):
            here = r0 + g < r1
            tok = tl.load(tok_ptr + r0 + g, mask=here, other=0).to(tl.int64)
            xv = tl.load(x_ptr + tok * K + c * SUPERBLOCK + j, mask=here, other=0.0)[None, :]
            acc_g += tl.where(gi == g, tl.sum(wg * xv, axis=1)[None, :], 0.0)
            acc_u += tl.where(gi == g, tl.sum(wu * xv, axis=1)[None, :], 0.0)
    r = r0 + tl.arange(0, G)
    keep = (r < r1)[:, None] & (n < F)[None, :]
    out = gu_ptr + r.to(tl.int64)[:, None] * (2 * F) + n[None, :]
    tl.store(out, acc_g, mask=keep)
    tl.store(out + F, acc_u, mask=keep)


@triton.jit
def _down_q4_k_kernel(av_ptr, pool_ptr, block_ptr, table_ptr, order_ptr, w_ptr, y_ptr, down_off, down_rb, D, F,
                      G: tl.constexpr, BN: tl.constexpr):
    """y[pair[r], n] = weight[pair[r]] * (down[n] . av[r]) for the sorted rows r of a tile, av the
    rows' activations (_act_kernel); grid (tiles, D/BN)."""
    rank, r0, r1 = _tile_rows(table_ptr, tl.program_id(0))
    if r1 <= r0:
        return
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mr = (n < D)[:, None]
    gi = tl.arange(0, G)[:, None]
    drow = base + down_off + n.to(tl.int64)[:, None] * down_rb
    j = tl.arange(0, SUPERBLOCK)
    acc = tl.zeros([G, BN], tl.float32)
    for c in range(0, F // SUPERBLOCK):
        wd = _q4_k_rows(drow, c, mr, BN)
        for g in tl.static_range(G):
            here = r0 + g < r1
            av = tl.load(av_ptr + (r0 + g).to(tl.int64) * F + c * SUPERBLOCK + j, mask=here, other=0.0)[None, :]
            acc += tl.where(gi == g, tl.sum(wd * av, axis=1)[None, :], 0.0)
    r = r0 + tl.arange(0, G)
    rm = r < r1
    pair = tl.load(order_ptr + r, mask=rm, other=0)
    acc = acc * tl.load(w_ptr + pair, mask=rm, other=0.0)[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc, mask=rm[:, None] & (n < D)[None, :])


def q4_k_tile_pairs(total: int, n_expert: int | None) -> int:
    """Pairs a tile of the Q4_K kernels for a step of `total` pairs (all of them, not a wave's: every
    wave of a cache tiles alike) over n_expert routed experts."""
    return G_Q4_K_FEW if n_expert and total < 3 * n_expert else G_Q4_K


def _experts_q4_k(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                  roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None, out: torch.Tensor,
                  n_expert: int | None) -> torch.Tensor:
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    total = offsets.shape[0]
    g = q4_k_tile_pairs(total, n_expert)
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, g, n_expert)
    n_tiles = t.table.shape[0]
    rows = t.order.shape[0]
    gu = torch.empty((rows, 2, f), dtype=torch.float32, device=x.device)
    _gate_up_q4_k_kernel[(n_tiles, triton.cdiv(f, BN))](
        x, t.tokens, pool, t.blocks, t.table, gu, roles.gate.offset, roles.up.offset, roles.gate.row_bytes,
        roles.up.row_bytes, f, k, G=g, BN=BN, num_warps=WARPS)
    av = torch.empty((rows, f), dtype=torch.float32, device=x.device)
    _act_kernel[(rows, triton.cdiv(f, ACT_BLOCK))](
        gu, pool, offsets, offsets, av, 0, 0, f, rows, act.limit, act.alpha, act.beta, act.linear_beta,
        ACT=int(act.kind), SPLITS=1, GU_BIAS=False, HAS_PAIRS=False, BF=ACT_BLOCK, num_warps=WARPS)
    _down_q4_k_kernel[(n_tiles, triton.cdiv(d, BN))](
        av, pool, t.blocks, t.table, t.order, weights, out, roles.down.offset, roles.down.row_bytes, d, f,
        G=g, BN=BN, num_warps=WARPS)
    return out


def experts_in_tiles(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                     roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, n_expert: int | None = None) -> torch.Tensor:
    """As moe_tl.experts_per_pair: x [T, K] float32, offsets [T*k] int64 (bytes into pool, multiples
    of 16), weights [T*k] float32 -> out [T*k, D], each pair's expert output times its routing
    weight; rows of pairs outside `pairs` are left as they were; `n_expert`, the layer's routed
    experts, bounds the launches (else the pairs and the pool do). No host sync."""
    total = offsets.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=x.device)
    if integer_runs(roles):  # every matrix Q4_K, no biases: K and F are multiples of 256
        return _experts_q4_k(x, pool, offsets, weights, roles, act, pairs, out, n_expert)
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, G, n_expert)
    n_tiles = t.table.shape[0]
    gu = torch.empty((t.order.shape[0], 2, f), dtype=torch.float32, device=x.device)
    _gate_up_kernel[(n_tiles, triton.cdiv(f, BN))](
        x, t.tokens, pool, t.blocks, t.table, gu, kernel_tables(x.device), roles.gate.offset, roles.up.offset, roles.gate.row_bytes,
        roles.up.row_bytes, f, k, QG=roles.gate.ggml_type, QU=roles.up.ggml_type, G=G, BN=BN, CH=CHUNK,
        num_warps=WARPS)
    _down_kernel[(n_tiles, triton.cdiv(d, BN))](
        gu, pool, t.blocks, t.table, t.order, weights, out, kernel_tables(x.device), roles.gate_bias or 0, roles.up_bias or 0,
        roles.down.offset, roles.down.row_bytes, roles.down_bias or 0, d, f, act.limit, act.alpha, act.beta,
        act.linear_beta, QD=roles.down.ggml_type, ACT=int(act.kind), GU_BIAS=roles.gate_bias is not None,
        DOWN_BIAS=roles.down_bias is not None, G=G, BN=BN, CH=CHUNK, num_warps=WARPS)
    return out
