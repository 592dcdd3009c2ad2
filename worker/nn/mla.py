"""Multi-head latent attention's projections, shared by the architectures that use the
converter's split form (DeepSeek-V2/V3, Kimi-K2, Kimi-K3): the query (through a LoRA rank or
directly), the normalized compressed kv with the rope part that all heads share, and per-head keys
and values expanded from the compressed kv with attn_k_b / attn_v_b (the torch path).

On the fast path attention runs in the latent (absorbed) form instead: attn_k_b is applied to the
query (q_nope W_kb, per head) rather than to every cached position, the cache holds the one
compressed kv and rope key per position that all heads share (multi-query attention over
kv_lora + rope channels), and attn_v_b is applied once to each head's attended latent. The same
products in another order: nothing is expanded per position, and no weight is dequantized per step."""

from __future__ import annotations

from typing import Callable

import torch

from ..weights.qtensor import head_linear, linear
from .layers import KVCache, attention, rms_norm


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


def absorbed_attention(w: dict, p: str, h: torch.Tensor, q: torch.Tensor, layer: int, cache: KVCache,
                       kv_lora: int, nope: int, eps: float, scale: float,
                       rotate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """MLA in its latent form: q [T, H, nope + rope] -> the heads' values [T, H, v]. `rotate`
    applies RoPE to the rope channels (of q [T, H, r] and of the shared key [T, 1, r]); None for
    NoPE models. The cache holds [S, 1, kv_lora + rope] keys and [S, 1, kv_lora] values."""
    t = h.shape[0]
    kv = linear(h, w[p + "attn_kv_a_mqa.weight"])  # [T, kv_lora + rope]
    c = rms_norm(kv[:, :kv_lora].contiguous(), w[p + "attn_kv_a_norm.weight"].dequant(), eps)[:, None, :]
    q_pe, k_pe = q[..., nope:], kv[:, None, kv_lora:]
    if rotate is not None:
        q_pe, k_pe = rotate(q_pe.contiguous()), rotate(k_pe.contiguous())
    q_lat = head_linear(q[..., :nope], w[p + "attn_k_b.weight"])  # [T, H, kv_lora]
    keys, values = cache.append(layer, torch.cat([c, k_pe], dim=-1), c)
    o = attention(torch.cat([q_lat, q_pe], dim=-1), keys, values, cache.positions(t, h.device), scale)
    return head_linear(o, w[p + "attn_v_b.weight"])  # [T, H, v]
