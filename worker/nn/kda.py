"""Kimi Delta Attention (Kimi-K3's linear layers): a recurrent layer whose "cache" is a fixed-size
state, not a growing KV. Per token: q, k, v through a short causal depthwise convolution and SiLU,
q and k L2-normalized per head; a per-channel log-decay g in (lower_bound, 0) from a low-rank
projection; a per-head write strength beta. Per head the state S [key, value] decays along the
key dimension, takes the delta-rule write S += k (beta (v - S^T k))^T, and answers o = S^T q /
sqrt(head_dim). The output is RMS-normalized per head, gated by sigmoid(g_proj x), projected.

KdaWeights resolves one layer's tensors from their GGUF names once, at load; `kda` reads its
attributes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights.qtensor import QTensor
from .ops import TorchOps


@dataclass(frozen=True)
class KdaWeights:
    """One KDA layer's tensors by role."""
    q: QTensor
    k: QTensor
    v: QTensor
    conv_q: QTensor  # the depthwise convolutions' taps, of q, k and v
    conv_k: QTensor
    conv_v: QTensor
    f_a: QTensor  # f_a, f_b and dt_bias: the low-rank projection of the log-decay
    f_b: QTensor
    dt_bias: QTensor
    a: QTensor  # -exp(A_log): a decay rate per head
    beta: QTensor  # the write strength per head
    norm: QTensor  # the output's per-head RMSNorm
    g: QTensor  # the output gate
    output: QTensor

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int) -> "KdaWeights":
        """Layer `layer`'s KDA from the trunk's tensors by name."""
        p = f"blk.{layer}."
        return cls(**{field: w[p + name] for field, name in _NAMES.items()})


_NAMES = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "conv_q": "ssm_conv1d_q.weight",
          "conv_k": "ssm_conv1d_k.weight", "conv_v": "ssm_conv1d_v.weight", "f_a": "ssm_f_a.weight",
          "f_b": "ssm_f_b.weight", "dt_bias": "ssm_dt.bias", "a": "ssm_a", "beta": "ssm_beta.weight",
          "norm": "ssm_norm.weight", "g": "ssm_g.weight", "output": "attn_output.weight"}


@dataclass
class KdaState:
    conv: dict[str, torch.Tensor]  # "q"/"k"/"v" -> the last kernel-1 projected inputs [kernel-1, d_inner]
    s: torch.Tensor  # [n_head, head_dim (key), head_dim (value)]

    capacity = None  # the same size at every position: nothing to reserve

    def reserve(self, capacity: int, length: int) -> None:
        """Nothing to move: the state already has its one shape."""

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), self.s]

    def clear(self) -> None:
        """The state before a first token (zeros, as `kda` makes it), in its own tensors."""
        for t in self.tensors():
            t.zero_()

    def assign(self, new: "KdaState") -> None:
        """Takes `new`'s values into this state's own tensors: a captured decode step reads and
        writes fixed buffers."""
        for mine, theirs in zip(self.tensors(), new.tensors()):
            mine.copy_(theirs)


def _conv(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of x [T, C] continuing `past` [K-1, C]; weight [C, K], the
    oldest tap first. Returns the outputs [T, C] and the new past."""
    k = weight.shape[1]
    full = torch.cat([past, x])  # [K-1+T, C]
    windows = full.unfold(0, k, 1)  # [T, C, K]
    return (windows * weight).sum(-1), full[-(k - 1):] if k > 1 else full[:0]


def _l2_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


def kda(ops: TorchOps, m: KdaWeights, x: torch.Tensor, state: KdaState | None, n_head: int, head_dim: int, lower_bound: float,
        eps: float) -> tuple[torch.Tensor, KdaState]:
    """x [T, D] (the normalized layer input) -> [T, D], and the state after these tokens."""
    t, d_inner = x.shape[0], n_head * head_dim
    if state is None:
        kernel = ops.dequant(m.conv_q).numel() // d_inner
        state = KdaState({n: x.new_zeros((kernel - 1, d_inner)) for n in "qkv"},
                         x.new_zeros((n_head, head_dim, head_dim)))
    conv: dict[str, torch.Tensor] = {}
    new_past: dict[str, torch.Tensor] = {}
    for n, proj, taps in (("q", m.q, m.conv_q), ("k", m.k, m.conv_k), ("v", m.v, m.conv_v)):
        weight = ops.dequant(taps).reshape(d_inner, -1)
        out, new_past[n] = _conv(ops.linear(x, proj), state.conv[n], weight)
        conv[n] = torch.nn.functional.silu(out).view(t, n_head, head_dim)
    q, k, v = _l2_normalized(conv["q"], eps), _l2_normalized(conv["k"], eps), conv["v"]

    f = ops.linear(ops.linear(x, m.f_a), m.f_b) + ops.dequant(m.dt_bias)
    decay_rate = -ops.dequant(m.a)  # exp(A_log): the GGUF stores -exp(A_log)
    g = lower_bound * torch.sigmoid(decay_rate[:, None] * f.view(t, n_head, head_dim))  # [T, H, d] in (lb, 0)
    beta = torch.sigmoid(ops.linear(x, m.beta))  # [T, H]

    s = state.s
    outs = []
    for i in range(t):
        s = s * torch.exp(g[i])[:, :, None]  # decay along the key dimension
        kv_mem = torch.einsum("hkv,hk->hv", s, k[i])
        s = s + torch.einsum("hk,hv->hkv", k[i], beta[i][:, None] * (v[i] - kv_mem))
        outs.append(torch.einsum("hkv,hk->hv", s, q[i]) * head_dim ** -0.5)
    o = torch.stack(outs)  # [T, H, d]

    o = ops.rms_norm(o, ops.dequant(m.norm), eps)
    gate = torch.sigmoid(ops.linear(x, m.g)).view(t, n_head, head_dim)
    return ops.linear((o * gate).reshape(t, d_inner), m.output), KdaState(new_past, s)
