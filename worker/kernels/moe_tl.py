"""Every expert a layer selected, in two launches, read through a byte-offset map: `offsets[p]` is
where the block of pair p's expert starts in `pool` (the resident table or the cache's slots), p
indexing the [T, k] routing flattened. The first launch computes gate and up (or a fused gate_up)
from the GGUF bytes and applies the activation in its epilogue; the second the down projection,
its bias and the routing weight, into one row per pair, which the caller sums over k in a fixed
order. A pair's result depends on its expert's bytes and its token only, never on where the block
sits or which other pairs run: a cache of any size gives the very bits of the resident table.
`pairs` restricts a launch to some pairs (a cache that loads a step's experts in waves)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation import Activation
from ..expert_roles import ExpertRoles
from .dequant_tl import CHUNK, chunk

BN = 16  # rows of an expert's matrix per program
WARPS = 4


@triton.jit
def _act(g, u, limit, alpha, beta, linear_beta, ACT: tl.constexpr):
    if ACT == 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        tl.static_assert(ACT == 2, "unknown activation")
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if linear_beta > 0:
            u = linear_beta * _tanh(u / linear_beta)
        a = a * u
    return a


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _gate_up_kernel(x_ptr, pool_ptr, off_ptr, pair_ptr, act_ptr,
                    gate_off, up_off, gate_rb, up_rb, gate_b, up_b, F, K, k_top,
                    limit, alpha, beta, linear_beta,
                    QG: tl.constexpr, QU: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_PAIRS: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """act[p, n] = act(gate[n] . x[t], up[n] . x[t]); grid (pairs, F/BN): pairs on the axis that
    takes more than 65535 (a long prefill)."""
    i, pid_n = tl.program_id(0), tl.program_id(1)
    if HAS_PAIRS:
        p = tl.load(pair_ptr + i).to(tl.int64)
    else:
        p = i.to(tl.int64)
    t = p // k_top
    base = pool_ptr + tl.multiple_of(tl.load(off_ptr + p), 16)  # blocks start 4096-aligned
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    rows = n.to(tl.int64)[:, None]
    grow = base + gate_off + rows * gate_rb
    urow = base + up_off + rows * up_rb
    acc_g = tl.zeros([BN, CH], tl.float32)
    acc_u = tl.zeros([BN, CH], tl.float32)
    for c in range(0, tl.cdiv(K, CH)):
        k = c * CH + j
        m = (n < F)[:, None] & (k < K)[None, :]
        xv = tl.load(x_ptr + t * K + k, mask=k < K, other=0.0)[None, :]
        acc_g += chunk(QG, grow, c, j[None, :], m) * xv
        acc_u += chunk(QU, urow, c, j[None, :], m) * xv
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        g += tl.load((base + gate_b).to(tl.pointer_type(tl.float32)) + n, mask=n < F, other=0.0)
        u += tl.load((base + up_b).to(tl.pointer_type(tl.float32)) + n, mask=n < F, other=0.0)
    tl.store(act_ptr + p * F + n, _act(g, u, limit, alpha, beta, linear_beta, ACT), mask=n < F)


@triton.jit
def _down_kernel(act_ptr, pool_ptr, off_ptr, pair_ptr, w_ptr, y_ptr, down_off, down_rb, down_b, D, F,
                 QD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PAIRS: tl.constexpr, BN: tl.constexpr,
                 CH: tl.constexpr):
    """y[p, n] = weight[p] * (down[n] . act[p] + bias[n]); grid (pairs, D/BN)."""
    i, pid_n = tl.program_id(0), tl.program_id(1)
    if HAS_PAIRS:
        p = tl.load(pair_ptr + i).to(tl.int64)
    else:
        p = i.to(tl.int64)
    base = pool_ptr + tl.multiple_of(tl.load(off_ptr + p), 16)  # blocks start 4096-aligned
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    drow = base + down_off + n.to(tl.int64)[:, None] * down_rb
    acc = tl.zeros([BN, CH], tl.float32)
    for c in range(0, tl.cdiv(F, CH)):
        k = c * CH + j
        m = (n < D)[:, None] & (k < F)[None, :]
        av = tl.load(act_ptr + p * F + k, mask=k < F, other=0.0)[None, :]
        acc += chunk(QD, drow, c, j[None, :], m) * av
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load((base + down_b).to(tl.pointer_type(tl.float32)) + n, mask=n < D, other=0.0)
    tl.store(y_ptr + p * D + n, y * tl.load(w_ptr + p), mask=n < D)


def experts_per_pair(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                     roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32, offsets [T*k] int64 (bytes into pool, multiples of 16), weights [T*k] float32 ->
    out [T*k, D]: each pair's expert output times its routing weight (rows of pairs outside
    `pairs`, when given, are left as they were)."""
    k_top = offsets.shape[0] // x.shape[0]
    n_pairs = offsets.shape[0] if pairs is None else pairs.shape[0]
    f, d = roles.gate.n, roles.down.n
    act_buf = torch.empty((offsets.shape[0], f), dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty((offsets.shape[0], d), dtype=torch.float32, device=x.device)
    has_bias = roles.gate_bias is not None
    pair_arg = pairs if pairs is not None else offsets  # unused when HAS_PAIRS is false
    _gate_up_kernel[(n_pairs, triton.cdiv(f, BN))](
        x, pool, offsets, pair_arg, act_buf,
        roles.gate.offset, roles.up.offset, roles.gate.row_bytes, roles.up.row_bytes,
        roles.gate_bias or 0, roles.up_bias or 0, f, roles.gate.k, k_top,
        act.limit, act.alpha, act.beta, act.linear_beta,
        QG=roles.gate.ggml_type, QU=roles.up.ggml_type, ACT=int(act.kind), HAS_BIAS=has_bias,
        HAS_PAIRS=pairs is not None, BN=BN, CH=CHUNK, num_warps=WARPS)
    _down_kernel[(n_pairs, triton.cdiv(d, BN))](
        act_buf, pool, offsets, pair_arg, weights, out, roles.down.offset, roles.down.row_bytes,
        roles.down_bias or 0, d, f,
        QD=roles.down.ggml_type, HAS_BIAS=roles.down_bias is not None, HAS_PAIRS=pairs is not None,
        BN=BN, CH=CHUNK, num_warps=WARPS)
    return out
