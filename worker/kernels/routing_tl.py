"""The softmax routers (routing.softmax_topk, routing.topk_softmax) in one launch per step instead of
four to six: a program per token holds its router logits, picks the top k one at a time (the
largest left, ties to the lower expert id) and writes ids and weights. float32, the formulas of
routing.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                         PARTS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr):
    """SOFTMAX_FIRST: softmax over all E, keep the top k (renormalized where NORMALIZE); else the
    top k logits, then a softmax over those k. The logits are the sum of PARTS rows (a router's
    split-K partial sums, added in order)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    x = tl.load(logits_ptr + t * PARTS * E + e, mask=e < E, other=0.0)
    for i in tl.static_range(1, PARTS):
        x += tl.load(logits_ptr + (t * PARTS + i) * E + e, mask=e < E, other=0.0)
    x = tl.where(e < E, x, -float("inf"))
    if SOFTMAX_FIRST:
        p = tl.exp(x - tl.max(x, axis=0))
        x = p / tl.sum(p, axis=0)
    kk = tl.arange(0, KP)  # K padded to a power of two; the padding holds 0 and is not stored
    ids = tl.zeros([KP], tl.int64)
    vals = tl.zeros([KP], tl.float32)
    left = x
    for i in tl.static_range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, BE), axis=0)  # the lowest id among equals
        ids = tl.where(kk == i, pick.to(tl.int64), ids)
        vals = tl.where(kk == i, best, vals)
        left = tl.where(e == pick, -float("inf"), left)
    if SOFTMAX_FIRST:
        if NORMALIZE:
            vals = vals / tl.sum(vals, axis=0)
    else:
        top = tl.where(kk < K, vals, -float("inf"))
        p = tl.exp(top - tl.max(top, axis=0))
        vals = p / tl.sum(p, axis=0)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, vals, mask=kk < K)


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, softmax_first: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (or [T, S, E], S partial sums) -> ids [T, k] int64, weights [T, k] float32."""
    t, e = logits.shape[0], logits.shape[-1]
    parts = logits.shape[1] if logits.dim() == 3 else 1
    x = logits.to(torch.float32).contiguous()
    ids = torch.empty((t, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    _softmax_topk_kernel[(t,)](x, ids, weights, e, K=k, KP=triton.next_power_of_2(k), BE=triton.next_power_of_2(e), PARTS=parts,
                               SOFTMAX_FIRST=softmax_first, NORMALIZE=normalize, num_warps=4)
    return ids, weights
