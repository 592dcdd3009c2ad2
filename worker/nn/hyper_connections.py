"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is `n` parallel streams
[T, n, D]. Around each block a small projection of the (unweighted-RMS-normalized, flattened)
streams gives per token: `pre` weights that collapse the streams into the block's input, `post`
weights that spread the block's output back over the streams, and a `comb` matrix, made doubly
stochastic by Sinkhorn iterations, that mixes the incoming streams into the outgoing ones. The
model's head collapses the streams once more with its own `pre` weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .layers import rms_norm

if TYPE_CHECKING:
    from .ops import TorchOps


def sinkhorn_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + n) * n] -> pre [T, n], post [T, n], comb [T, n, n] (doubly stochastic)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams).sum(dim=1)


def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The streams [T, n, D] collapsed by `pre` [T, n] and RMS-normalized times weight [D]."""
    return rms_norm(collapse(streams, pre), weight, eps)


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The block's output spread by `post`, plus the incoming streams mixed by comb (transposed:
    outgoing stream d takes sum_s comb[s, d] * incoming s)."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


@dataclass(frozen=True)
class HyperConnection:
    fn: torch.Tensor  # [(2 + n) * n, n * D] (the head's: [n, n * D])
    base: torch.Tensor  # [(2 + n) * n] (the head's: [n])
    scale: torch.Tensor  # [3] (the head's: [1])
    n: int
    sinkhorn_iters: int
    eps: float  # hyper-connection epsilon
    norm_eps: float  # the model's RMSNorm epsilon

    def _mixes(self, ops: TorchOps, streams: torch.Tensor) -> torch.Tensor:
        flat = ops.rms_norm(streams.reshape(streams.shape[0], -1).float(), None, self.norm_eps)
        return F.linear(flat, self.fn.float())

    def weights(self, ops: TorchOps, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> pre [T, n], post [T, n], comb [T, n, n]."""
        return ops.hc_weights(self._mixes(ops, streams), self.base, self.scale, self.n, self.sinkhorn_iters, self.eps)

    def block_input(self, ops: TorchOps, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
        """The streams collapsed by `pre` and RMS-normalized times the block's norm weight [D]."""
        return ops.hc_collapse_norm(streams, pre, weight, self.norm_eps)

    def head(self, ops: TorchOps, streams: torch.Tensor) -> torch.Tensor:
        """The final collapse before the output norm: sigmoid(mixes * scale + base) + eps."""
        pre = torch.sigmoid(self._mixes(ops, streams) * self.scale.float() + self.base.float()) + self.eps
        return collapse(streams, pre)
