"""Kimi Delta Attention (Kimi-K3's linear layers): a recurrent layer whose "cache" is a fixed-size
state, not a growing KV. Per token: q, k, v through a short causal depthwise convolution and SiLU,
q and k L2-normalized per head; a per-channel log-decay g in (lower_bound, 0) from a low-rank
projection; a per-head write strength beta. Per head the state S [key, value] decays along the
key dimension, takes the delta-rule write S += k (beta (v - S^T k))^T, and answers o = S^T q /
sqrt(head_dim). The output is RMS-normalized per head, gated by sigmoid(g_proj x), projected."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights.qtensor import linear
from .layers import rms_norm


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


def kda(w: dict, p: str, x: torch.Tensor, state: KdaState | None, n_head: int, head_dim: int, lower_bound: float,
        eps: float) -> tuple[torch.Tensor, KdaState]:
    """x [T, D] (the normalized layer input) -> [T, D], and the state after these tokens."""
    t, d_inner = x.shape[0], n_head * head_dim
    if state is None:
        kernel = w[p + "ssm_conv1d_q.weight"].dequant().numel() // d_inner
        state = KdaState({n: x.new_zeros((kernel - 1, d_inner)) for n in "qkv"},
                         x.new_zeros((n_head, head_dim, head_dim)))
    conv: dict[str, torch.Tensor] = {}
    new_past: dict[str, torch.Tensor] = {}
    for n in "qkv":
        weight = w[p + f"ssm_conv1d_{n}.weight"].dequant().reshape(d_inner, -1)
        out, new_past[n] = _conv(linear(x, w[p + f"attn_{n}.weight"]), state.conv[n], weight)
        conv[n] = torch.nn.functional.silu(out).view(t, n_head, head_dim)
    q, k, v = _l2_normalized(conv["q"], eps), _l2_normalized(conv["k"], eps), conv["v"]

    f = linear(linear(x, w[p + "ssm_f_a.weight"]), w[p + "ssm_f_b.weight"]) + w[p + "ssm_dt.bias"].dequant()
    decay_rate = -w[p + "ssm_a"].dequant()  # exp(A_log): the GGUF stores -exp(A_log)
    g = lower_bound * torch.sigmoid(decay_rate[:, None] * f.view(t, n_head, head_dim))  # [T, H, d] in (lb, 0)
    beta = torch.sigmoid(linear(x, w[p + "ssm_beta.weight"]))  # [T, H]

    s = state.s
    outs = []
    for i in range(t):
        s = s * torch.exp(g[i])[:, :, None]  # decay along the key dimension
        kv_mem = torch.einsum("hkv,hk->hv", s, k[i])
        s = s + torch.einsum("hk,hv->hkv", k[i], beta[i][:, None] * (v[i] - kv_mem))
        outs.append(torch.einsum("hkv,hk->hv", s, q[i]) * head_dim ** -0.5)
    o = torch.stack(outs)  # [T, H, d]

    o = rms_norm(o, w[p + "ssm_norm.weight"].dequant(), eps)
    gate = torch.sigmoid(linear(x, w[p + "ssm_g.weight"])).view(t, n_head, head_dim)
    return linear((o * gate).reshape(t, d_inner), w[p + "attn_output.weight"]), KdaState(new_past, s)
