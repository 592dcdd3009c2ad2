"""Routing functions: router logits [T, n_expert] -> (expert ids [T, k], weights [T, k]). Pure
functions, each the formula of one family of models, tested against a naive per-token loop; torch's
path (ops.TorchOps), where triton_ops.TritonOps runs kernels/routing_tl.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2/3-MoE, Mixtral, OLMoE: softmax over all experts, keep the top k (renormalized or not)."""
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the top k logits, then a softmax over those k."""
    top, ids = torch.topk(logits.to(torch.float32), k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                       normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3/R1, Kimi-K2: sigmoid scores; the correction bias decides the selection only;
    experts are chosen among the `topk_group` groups with the best sum of their top-2 biased scores;
    weights are the unbiased scores (renormalized), times the routed scaling factor. Experts of the
    groups left out score 0, as in the reference implementation."""
    scores = torch.sigmoid(logits.to(torch.float32))
    biased = scores + bias
    t, n = biased.shape
    if n_group > 1:
        grouped = biased.reshape(t, n_group, n // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        mask = keep[:, :, None].expand(t, n_group, n // n_group).reshape(t, n)
        biased = biased.masked_fill(~mask, 0.0)
    ids = biased.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def sqrtsoftplus_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 top-k layers: scores sqrt(softplus(logit)); the correction bias decides the
    selection only; the chosen scores, renormalized, times the routed scaling factor."""
    scores = F.softplus(logits.to(torch.float32)).sqrt()
    ids = (scores + bias).topk(k, dim=-1).indices
    return ids, _renormalized(scores.gather(1, ids), scale)


def sqrtsoftplus_hashed(logits: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 hash layers: the experts are table[token] (a fixed token-id -> experts table,
    known before the layer runs); the weights are their sqrt-softplus scores, renormalized."""
    scores = F.softplus(logits.to(torch.float32)).sqrt()
    ids = table[tokens].to(torch.int64)
    return ids, _renormalized(scores.gather(1, ids), scale)


def _renormalized(weights: torch.Tensor, scale: float) -> torch.Tensor:
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale
