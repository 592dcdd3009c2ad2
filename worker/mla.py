"""Multi-head latent attention's projections, shared by the architectures that use the
converter's split form (DeepSeek-V2/V3, Kimi-K2, Kimi-K3): the query (through a LoRA rank or
directly), the normalized compressed kv with the rope part that all heads share, and per-head keys
and values expanded from the compressed kv with attn_k_b / attn_v_b."""

from __future__ import annotations

import torch

from .layers import rms_norm
from .weights import linear


def mla_query(w: dict, p: str, h: torch.Tensor, n_head: int, key_mla: int, eps: float) -> torch.Tensor:
    """[T, n_head, key_mla]: nope then rope channels per head."""
    if p + "attn_q_a.weight" in w:
        q = linear(rms_norm(linear(h, w[p + "attn_q_a.weight"]), w[p + "attn_q_a_norm.weight"].dequant(), eps),
                   w[p + "attn_q_b.weight"])
    else:
        q = linear(h, w[p + "attn_q.weight"])
    return q.reshape(len(h), n_head, key_mla)


def mla_keys_values(w: dict, p: str, h: torch.Tensor, kv_lora: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_nope [T, H, nope], the shared rope key [T, 1, rope] (not rotated here), values [T, H, v]."""
    kv = linear(h, w[p + "attn_kv_a_mqa.weight"])  # [T, kv_lora + rope]
    c = rms_norm(kv[:, :kv_lora], w[p + "attn_kv_a_norm.weight"].dequant(), eps)
    k_nope = torch.einsum("tc,hcn->thn", c, w[p + "attn_k_b.weight"].dequant())
    value = torch.einsum("tc,hvc->thv", c, w[p + "attn_v_b.weight"].dequant())
    return k_nope, kv[:, None, kv_lora:], value
