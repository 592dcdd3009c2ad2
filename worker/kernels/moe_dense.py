"""A prefill's experts as grouped matrix products: the step's pairs sorted by expert block, each
selected expert dequantized once (many experts per launch, straight from the pool's bytes), then
one launch per matrix for all of them: a program takes a tile of up to BM pairs of one expert and
meets them with that expert's rows on tensor cores, where the per-pair kernels of moe_tl decode an
expert's bytes again for every pair. Pays when an expert has many tokens (a long prompt); the
caller chooses by the whole step's routing.

Precision: float32 inputs on TF32 tensor cores in three passes (`tf32x3`: each operand split into a
TF32 head and tail, head*head + head*tail + tail*head), fp32 accumulation: float32's precision
within a few ulps per product, at tensor-core speed (IEEE float32 `tl.dot` measured 25x slower).

An expert's result depends on its bytes and its tokens only: a pair's row is computed by a tile of
fixed shape over K in a fixed order, whichever other pairs share the tile or the launch, so a cache
that loads a step's experts in waves gives the very bits of the resident table. Dequantized
experts are held in groups (scratch_values) of half what the device has free, between
GROUP_VALUES and GROUP_VALUES_FREE floats (Qwen3-30B-A3B's 128 at 512 tokens, 2.4 GB, in one group
where 4.8 GB are free), so a model with large experts, or a GPU full of expert cache, stays within
a bounded scratch. The group does not change a pair's bits (above), only the speed: each group's
products end in a tail of idle multiprocessors, so fewer, larger groups are faster."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nn.activation import Activation
from ..weights.expert_roles import ExpertRoles, MatrixRole
from ..weights.quant_iq import kernel_tables
from .dequant_tl import CHUNK, chunk
from .expert_tiles import expert_tiles, tile_at
from .moe_tl import _act

BN_DEQUANT = 16  # rows of an expert's matrix per dequantizing program
GROUP_VALUES = 1 << 28  # float32 values of dequantized experts held at once: at least (1 GiB), as in a graph
GROUP_VALUES_FREE = 1 << 30  # at most (4 GiB), where the device has twice their bytes free
BM, BN, BK = 64, 128, 32  # a product's tile: pairs of one expert x rows of its matrix x the K step
WARPS, STAGES = 4, 3
PRECISION = "tf32x3"


@triton.jit
def _dequant_blocks_kernel(pool_ptr, block_ptr, n_ptr, first, out_ptr, tab, role_off, N, K, row_bytes, expert_stride,
                           QT: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """out[e, n, k] (at out_ptr + e * expert_stride, rows of K floats) = the role's matrix in the
    block of expert rank first + e (at pool + block[first + e]), for the ranks below n[0] (the
    step's distinct experts, counted on the device); grid (N/BN, K/CH, experts of the group)."""
    pid_n, c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if first + e >= tl.load(n_ptr):
        return
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    k = c * CH + j
    m = (n < N)[:, None] & (k < K)[None, :]
    base = pool_ptr + tl.multiple_of(tl.load(block_ptr + first + e), 16) + role_off
    w = chunk(QT, base + n.to(tl.int64)[:, None] * row_bytes, c, j[None, :], m, tab)
    tl.store(out_ptr + e.to(tl.int64) * expert_stride + n.to(tl.int64)[:, None] * K + k[None, :], w, mask=m)


@triton.jit
def _grouped_gate_up_kernel(x_ptr, tok_ptr, w_ptr, tiles_ptr, first, experts, gu_ptr, N, K, w_stride,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """gu[r, n] = W_e[n] . x[tok[r]] for the sorted pair rows r of a tile of expert e (W_e: gate's
    rows, then up's, N = 2F), for the tiles of the group's experts; grid (tiles, N/BN)."""
    _, e, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), first, experts, BM)
    if elsewhere:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    tok = tl.load(tok_ptr + r, mask=rm, other=0).to(tl.int64)
    w = w_ptr + e.to(tl.int64) * w_stride + n.to(tl.int64)[None, :] * K
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(x_ptr + tok[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(w + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(gu_ptr + r.to(tl.int64)[:, None] * N + n[None, :], acc, mask=rm[:, None] & nm[None, :])


@triton.jit
def _grouped_down_kernel(gu_ptr, w_ptr, tiles_ptr, first, experts, pair_ptr, wt_ptr, out_ptr, pool_ptr, block_ptr,
                         gate_b, up_b, down_b, D, F, w_stride, limit, alpha, beta, linear_beta, ACT: tl.constexpr,
                         GU_BIAS: tl.constexpr, DOWN_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair[r], n] = weight[pair[r]] * (W_e[n] . act(gate[r] + bg, up[r] + bu) + bd[n]), the
    activation applied as each K tile of gu is read, the biases read from expert e's block;
    grid (tiles, D/BN)."""
    rank, e, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), first, experts, BM)
    if elsewhere:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    block = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    w = w_ptr + e.to(tl.int64) * w_stride + n.to(tl.int64)[None, :] * F
    g_row = gu_ptr + r.to(tl.int64)[:, None] * (2 * F)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, F, BK):
        k = k0 + tl.arange(0, BK)
        km = k < F
        am = rm[:, None] & km[None, :]
        g = tl.load(g_row + k[None, :], mask=am, other=0.0)
        u = tl.load(g_row + F + k[None, :], mask=am, other=0.0)
        if GU_BIAS:
            g += tl.load((block + gate_b).to(tl.pointer_type(tl.float32)) + k, mask=km, other=0.0)[None, :]
            u += tl.load((block + up_b).to(tl.pointer_type(tl.float32)) + k, mask=km, other=0.0)[None, :]
        a = tl.where(am, _act(g, u, limit, alpha, beta, linear_beta, ACT), 0.0)
        b = tl.load(w + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if DOWN_BIAS:
        acc += tl.load((block + down_b).to(tl.pointer_type(tl.float32)) + n, mask=nm, other=0.0)[None, :]
    pair = tl.load(pair_ptr + r, mask=rm, other=0)
    acc = acc * tl.load(wt_ptr + pair, mask=rm, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc, mask=rm[:, None] & nm[None, :])


def _dequantize_into(out: torch.Tensor, pool: torch.Tensor, blocks: torch.Tensor, n_experts: torch.Tensor,
                     first: int, role: MatrixRole) -> None:
    """out [E, >=N rows, K] (rows contiguous, any expert stride) <- the role's matrix of the
    experts of ranks first .. first+E-1 (those below n_experts[0])."""
    grid = (triton.cdiv(role.n, BN_DEQUANT), triton.cdiv(role.k, CHUNK), out.shape[0])
    _dequant_blocks_kernel[grid](pool, blocks, n_experts, first, out, kernel_tables(out.device), role.offset, role.n, role.k, role.row_bytes,
                                 out.stride(0), QT=role.ggml_type, BN=BN_DEQUANT, CH=CHUNK, num_warps=4)


def group_values(free_bytes: int) -> int:
    """Float32 values the dequantized experts of one group may take, with free_bytes free on the
    device: half of them (half stays for the rest of the step and for what fragments), between
    GROUP_VALUES and GROUP_VALUES_FREE."""
    return max(GROUP_VALUES, min(GROUP_VALUES_FREE, free_bytes // 8))


def scratch_values(dev: torch.device) -> int:
    """group_values on this device: the driver's free memory and the blocks torch holds unused (an
    estimate: some of those are fragments, or a graph pool's). GROUP_VALUES while a CUDA graph is
    captured, whose pool would keep the scratch as long as the graph lives. No host sync."""
    if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return GROUP_VALUES
    free, _ = torch.cuda.mem_get_info(dev)
    stats = torch.cuda.memory_stats(dev)
    unused = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    return group_values(free + unused)


def experts_dense(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                  roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, n_expert: int | None = None) -> torch.Tensor:
    """As moe_tl.experts_per_pair: x [T, K] float32, offsets [T*k] int64 (bytes into pool, multiples
    of 16), weights [T*k] float32 -> out [T*k, D], each pair's expert output times its routing
    weight; rows of pairs outside `pairs` are left as they were; `n_expert`, the layer's routed
    experts, bounds the launches (else the pairs and the pool do). No host sync: the launches are
    sized by the bound on distinct experts (the pairs, the blocks the pool can hold), and programs
    past the step's true count return at once."""
    total = offsets.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    dev = x.device
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=dev)
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, BM, n_expert)
    order, tokens, blocks, n_experts, tiles, max_experts = t.order, t.tokens, t.blocks, t.n_experts, t.table, t.max_experts
    gu = torch.empty((order.shape[0], 2 * f), dtype=torch.float32, device=dev)
    per_group = max(1, min(max_experts, scratch_values(dev) // (2 * f * k + d * f)))
    w_gu = torch.empty((per_group, 2 * f, k), dtype=torch.float32, device=dev)
    w_down = torch.empty((per_group, d, f), dtype=torch.float32, device=dev)
    n_tiles = tiles.shape[0]
    for first in range(0, max_experts, per_group):
        _dequantize_into(w_gu, pool, blocks, n_experts, first, roles.gate)
        _dequantize_into(w_gu[:, f:], pool, blocks, n_experts, first, roles.up)
        _dequantize_into(w_down, pool, blocks, n_experts, first, roles.down)
        _grouped_gate_up_kernel[(n_tiles, triton.cdiv(2 * f, BN))](
            x, tokens, w_gu, tiles, first, per_group, gu, 2 * f, k, w_gu.stride(0),
            BM=BM, BN=BN, BK=BK, PRECISION=PRECISION, num_warps=WARPS, num_stages=STAGES)
        _grouped_down_kernel[(n_tiles, triton.cdiv(d, BN))](
            gu, w_down, tiles, first, per_group, order, weights, out, pool, blocks, roles.gate_bias or 0,
            roles.up_bias or 0, roles.down_bias or 0, d, f, w_down.stride(0), act.limit, act.alpha, act.beta,
            act.linear_beta, ACT=int(act.kind), GU_BIAS=roles.gate_bias is not None,
            DOWN_BIAS=roles.down_bias is not None, BM=BM, BN=BN, BK=BK, PRECISION=PRECISION, num_warps=WARPS,
            num_stages=STAGES)
    return out
