"""DeepSeek-V4's hyper-connections (hyper_connections.HyperConnection) in few launches. The
weights in one: a program per token turns its (2 + n) * n mixes into `pre`, `post` and the
Sinkhorn-normalized `comb`, where torch spends about 120 launches of a few values each (20
iterations of two sums and two divisions) on every hyper-connection, two a layer. The collapse into
the block's normalized input in one (torch: a product, a sum and the norm), the expansion of the
block's output over the streams in one (a product, a batched matmul and a sum). float32, the
formulas of hyper_connections.py (the weights' in the same order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, n, iters, eps,
                       BN: tl.constexpr):
    """mixes[t] = pre_w [n], post_w [n], comb_w [n, n] (row-major); grid (T,)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BN)
    row = i[:, None]
    col = i[None, :]
    vm = i < n
    mm = (row < n) & (col < n)
    mix = mix_ptr + t * (2 + n) * n
    pre = tl.load(mix + i, mask=vm, other=0.0) * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=vm, other=0.0)
    post = tl.load(mix + n + i, mask=vm, other=0.0) * tl.load(scale_ptr + 1) + tl.load(base_ptr + n + i, mask=vm,
                                                                                      other=0.0)
    tl.store(pre_ptr + t * n + i, tl.sigmoid(pre) + eps, mask=vm)
    tl.store(post_ptr + t * n + i, 2 * tl.sigmoid(post), mask=vm)
    logits = (tl.load(mix + 2 * n + row * n + col, mask=mm, other=0.0) * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + 2 * n + row * n + col, mask=mm, other=0.0))
    logits = tl.where(mm, logits, -1e30)  # padding: rows of ones, columns of zeros
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(mm, p / tl.sum(p, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * n * n + row * n + col, comb, mask=mm)


def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + n) * n], base [(2 + n) * n], scale [3] (float32) -> pre [T, n], post [T, n],
    comb [T, n, n]."""
    t = mixes.shape[0]
    dev = mixes.device
    pre = torch.empty((t, n), dtype=torch.float32, device=dev)
    post = torch.empty((t, n), dtype=torch.float32, device=dev)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=dev)
    _hc_weights_kernel[(t,)](mixes.float().contiguous(), base.float().contiguous(), scale.float().contiguous(),
                             pre, post, comb, n, iters, eps, BN=triton.next_power_of_2(n), num_warps=1)
    return pre, post, comb


@triton.jit
def _collapse_norm_kernel(streams_ptr, pre_ptr, w_ptr, y_ptr, D, eps, N: tl.constexpr, BD: tl.constexpr):
    """grid (T,): y[t] = rms_norm(sum_s pre[t, s] * streams[t, s]) * w."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    x = tl.zeros([BD], tl.float32)
    for s in tl.static_range(N):
        x += tl.load(pre_ptr + t * N + s) * tl.load(streams_ptr + (t * N + s) * D + d, mask=d < D, other=0.0)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)) * tl.load(w_ptr + d, mask=d < D, other=0.0)
    tl.store(y_ptr + t * D + d, y, mask=d < D)


def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, n, D], pre [T, n], weight [D] (float32) -> the block's input [T, D]."""
    t, n, d = streams.shape
    out = torch.empty((t, d), dtype=torch.float32, device=streams.device)
    _collapse_norm_kernel[(t,)](streams.contiguous(), pre.contiguous(), weight.contiguous(), out, d, eps, N=n,
                                BD=triton.next_power_of_2(d), num_warps=4 if d <= 4096 else 8)
    return out


@triton.jit
def _expand_kernel(streams_ptr, out_ptr, post_ptr, comb_ptr, y_ptr, D, N: tl.constexpr, BN: tl.constexpr,
                   BD: tl.constexpr):
    """grid (T, cdiv(D, BD)): y[t, o] = post[t, o] * out[t] + sum_s comb[t, s, o] * streams[t, s]."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    o = tl.arange(0, BN)
    om = o < N
    x = tl.load(out_ptr + t * D + d, mask=d < D, other=0.0)
    y = tl.load(post_ptr + t * N + o, mask=om, other=0.0)[:, None] * x[None, :]  # [BN, BD]
    for s in tl.static_range(N):
        c = tl.load(comb_ptr + (t * N + s) * N + o, mask=om, other=0.0)
        y += c[:, None] * tl.load(streams_ptr + (t * N + s) * D + d, mask=d < D, other=0.0)[None, :]
    tl.store(y_ptr + (t * N + o[:, None]) * D + d[None, :], y, mask=om[:, None] & (d < D)[None, :])


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, n, D], the block's output [T, D], post [T, n], comb [T, n, n] -> the new
    streams [T, n, D]."""
    t, n, d = streams.shape
    y = torch.empty((t, n, d), dtype=torch.float32, device=streams.device)
    block = 256
    _expand_kernel[(t, triton.cdiv(d, block))](streams.contiguous(), out.contiguous(), post.contiguous(),
                                               comb.contiguous(), y, d, N=n, BN=triton.next_power_of_2(n), BD=block,
                                               num_warps=4)
    return y
