"""A prefill's experts as dense matrix products: the step's pairs sorted by expert block, each
selected expert dequantized once (many experts per launch, straight from the pool's bytes) and met
by all of its tokens in one cuBLAS float32 product per matrix, where the per-pair kernels of
moe_tl decode an expert's bytes again for every pair. Pays when an expert has many tokens (a long
prompt); the caller chooses by the whole step's routing.

An expert's result depends on its bytes, its tokens and their number only: one product of the
same shape per expert, whatever else runs (cuBLAS is deterministic for a given shape, and float32
products never use TF32 here), so a cache that loads a step's experts in waves, each wave holding
every pair of its experts, gives the very bits of the resident table. Dequantized experts are
held in groups of at most GROUP_VALUES floats, so a model with large experts stays within a
bounded scratch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation import Activation
from ..expert_roles import ExpertRoles, MatrixRole
from .dequant_tl import CHUNK, chunk

BN = 16  # rows of an expert's matrix per dequantizing program
GROUP_VALUES = 1 << 28  # float32 values of dequantized experts held at once (1 GiB)


@triton.jit
def _dequant_blocks_kernel(pool_ptr, base_ptr, out_ptr, role_off, N, K, row_bytes, expert_stride,
                           QT: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """out[e, n, k] (expert e at out_ptr + e * expert_stride, rows of K floats) = the role's matrix
    in the block at pool + base[e]; grid (N/BN, K/CH, experts)."""
    pid_n, c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    k = c * CH + j
    m = (n < N)[:, None] & (k < K)[None, :]
    base = pool_ptr + tl.multiple_of(tl.load(base_ptr + e), 16) + role_off
    w = chunk(QT, base + n.to(tl.int64)[:, None] * row_bytes, c, j[None, :], m)
    tl.store(out_ptr + e.to(tl.int64) * expert_stride + n.to(tl.int64)[:, None] * K + k[None, :], w, mask=m)


def _dequantize_into(out: torch.Tensor, pool: torch.Tensor, bases: torch.Tensor, role: MatrixRole) -> None:
    """out [E, >=N rows, K] (rows contiguous, any expert stride) <- the role's matrix of each block."""
    grid = (triton.cdiv(role.n, BN), triton.cdiv(role.k, CHUNK), bases.shape[0])
    _dequant_blocks_kernel[grid](pool, bases, out, role.offset, role.n, role.k, role.row_bytes, out.stride(0),
                                 QT=role.ggml_type, BN=BN, CH=CHUNK, num_warps=4)


def _biases(pool: torch.Tensor, bases: torch.Tensor, offset: int, n: int, sizes: list[int]) -> torch.Tensor:
    """[sum(sizes), n] float32: the bias vector at offset in each block, once per pair of its expert."""
    at = bases[:, None] + offset + torch.arange(4 * n, device=pool.device)
    return pool[at].view(torch.float32).repeat_interleave(torch.tensor(sizes, device=pool.device), dim=0)


def experts_dense(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                  roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As moe_tl.experts_per_pair: x [T, K] float32, offsets [T*k] int64 (bytes into pool, multiples
    of 16), weights [T*k] float32 -> out [T*k, D], each pair's expert output times its routing
    weight; rows of pairs outside `pairs` are left as they were. One host sync: the experts and
    their pair counts."""
    total = offsets.shape[0]
    k_top = total // x.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=x.device)
    idx = pairs.to(torch.int64) if pairs is not None else torch.arange(total, device=x.device)
    sorted_off, perm = torch.sort(offsets[idx], stable=True)
    order = idx[perm]
    blocks, counts = torch.unique_consecutive(sorted_off, return_counts=True)
    counts_host = counts.tolist()
    xs = x[order // k_top]  # the pairs' tokens, sorted by expert
    gu = torch.empty((order.shape[0], 2 * f), dtype=torch.float32, device=x.device)
    y = torch.empty((order.shape[0], d), dtype=torch.float32, device=x.device)
    per_group = max(1, GROUP_VALUES // (2 * f * k + d * f))
    first = 0  # the group's first pair in sorted order
    for g0 in range(0, len(counts_host), per_group):
        sizes = counts_host[g0:g0 + per_group]
        rows = slice(first, first + sum(sizes))
        first = rows.stop
        bases = blocks[g0:g0 + len(sizes)].contiguous()
        w_gu = torch.empty((len(sizes), 2 * f, k), dtype=torch.float32, device=x.device)
        w_down = torch.empty((len(sizes), d, f), dtype=torch.float32, device=x.device)
        _dequantize_into(w_gu, pool, bases, roles.gate)
        _dequantize_into(w_gu[:, f:], pool, bases, roles.up)
        _dequantize_into(w_down, pool, bases, roles.down)
        for e, (xe, gue) in enumerate(zip(xs[rows].split(sizes), gu[rows].split(sizes))):
            torch.mm(xe, w_gu[e].T, out=gue)
        g, u = gu[rows, :f], gu[rows, f:]
        if roles.gate_bias is not None:
            g = g + _biases(pool, bases, roles.gate_bias, f, sizes)
            u = u + _biases(pool, bases, roles.up_bias, f, sizes)
        a = act(g, u).contiguous()
        for e, (ae, ye) in enumerate(zip(a.split(sizes), y[rows].split(sizes))):
            torch.mm(ae, w_down[e].T, out=ye)
        if roles.down_bias is not None:
            y[rows] += _biases(pool, bases, roles.down_bias, d, sizes)
    out[order] = y * weights[order, None]
    return out
