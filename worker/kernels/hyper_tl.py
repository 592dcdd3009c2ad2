"""DeepSeek-V4's hyper-connection weights (hyper_connections.HyperConnection.weights) in one launch:
a program per token turns its (2 + n) * n mixes into `pre`, `post` and the Sinkhorn-normalized
`comb`, where torch spends about 120 launches of a few values each (20 iterations of two sums and
two divisions) on every hyper-connection, four a layer. float32, the formulas of
hyper_connections.py in the same order."""

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
