"""Multi-head latent attention's projections, shared by the architectures that use the
converter's split form (DeepSeek-V2/V3, Kimi-K2, Kimi-K3): the query (through a LoRA rank or
directly), the normalized compressed kv with the rope part that all heads share, and per-head keys
and values expanded from the compressed kv with attn_k_b / attn_v_b (the torch path).

On the fast path attention runs in the latent (absorbed) form instead: attn_k_b is applied to the
query (q_nope W_kb, per head) rather than to every cached position, the cache holds the one
compressed kv and rope key per position that all heads share (multi-query attention over
kv_lora + rope channels), and attn_v_b is applied once to each head's attended latent. The same
products in another order: nothing is expanded per position, and no weight is dequantized per step.

MlaWeights resolves one layer's tensors from their GGUF names once, at load; these functions read
its attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..weights.qtensor import QTensor
from .layers import KVCache
from .ops import TorchOps


@dataclass(frozen=True)
class MlaWeights:
    """One layer's MLA tensors by role. The query goes through a LoRA rank (q_a, q_a_norm, q_b) or,
    where the GGUF has no q LoRA (DeepSeek-V2-Lite), through one matrix (q): the other set is None."""
    kv_a_mqa: QTensor  # to the compressed kv (kv_lora) and the rope key all heads share (rope)
    kv_a_norm: QTensor
    k_b: QTensor  # per head, compressed kv -> k_nope
    v_b: QTensor  # per head, compressed kv -> value
    output: QTensor
    q: QTensor | None = None
    q_a: QTensor | None = None
    q_a_norm: QTensor | None = None
    q_b: QTensor | None = None

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int) -> "MlaWeights":
        """Layer `layer`'s attention from the trunk's tensors by name."""
        p = f"blk.{layer}."
        if p + "attn_q_a.weight" in w:  # a q LoRA rank
            query = {"q_a": w[p + "attn_q_a.weight"], "q_a_norm": w[p + "attn_q_a_norm.weight"],
                     "q_b": w[p + "attn_q_b.weight"]}
        else:
            query = {"q": w[p + "attn_q.weight"]}
        return cls(w[p + "attn_kv_a_mqa.weight"], w[p + "attn_kv_a_norm.weight"], w[p + "attn_k_b.weight"],
                   w[p + "attn_v_b.weight"], w[p + "attn_output.weight"], **query)


def mla_query(ops: TorchOps, m: MlaWeights, h: torch.Tensor, n_head: int, key_mla: int, eps: float) -> torch.Tensor:
    """[T, n_head, key_mla]: nope then rope channels per head."""
    if m.q_a is not None:
        q = ops.linear(ops.rms_norm(ops.linear(h, m.q_a), ops.dequant(m.q_a_norm), eps), m.q_b)
    else:
        q = ops.linear(h, m.q)
    return q.reshape(len(h), n_head, key_mla)


def mla_keys_values(ops: TorchOps, m: MlaWeights, h: torch.Tensor, kv_lora: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_nope [T, H, nope], the shared rope key [T, 1, rope] (not rotated here), values [T, H, v]."""
    kv = ops.linear(h, m.kv_a_mqa)  # [T, kv_lora + rope]
    c = ops.rms_norm(kv[:, :kv_lora], ops.dequant(m.kv_a_norm), eps)
    k_nope = torch.einsum("tc,hcn->thn", c, ops.dequant(m.k_b))
    value = torch.einsum("tc,hvc->thv", c, ops.dequant(m.v_b))
    return k_nope, kv[:, None, kv_lora:], value


def absorbed_attention(ops: TorchOps, m: MlaWeights, h: torch.Tensor, q: torch.Tensor, layer: int, cache: KVCache,
                       kv_lora: int, nope: int, eps: float, scale: float,
                       rotate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """MLA in its latent form: q [T, H, nope + rope] -> the heads' values [T, H, v]. `rotate`
    applies RoPE to the rope channels (of q [T, H, r] and of the shared key [T, 1, r]); None for
    NoPE models. The cache holds [S, 1, kv_lora + rope] keys and [S, 1, kv_lora] values."""
    t = h.shape[0]
    kv = ops.linear(h, m.kv_a_mqa)  # [T, kv_lora + rope]
    c = ops.rms_norm(kv[:, :kv_lora].contiguous(), ops.dequant(m.kv_a_norm), eps)[:, None, :]
    q_pe, k_pe = q[..., nope:], kv[:, None, kv_lora:]
    if rotate is not None:
        q_pe, k_pe = rotate(q_pe.contiguous()), rotate(k_pe.contiguous())
    q_lat = ops.head_linear(q[..., :nope], m.k_b)  # [T, H, kv_lora]
    keys, values = cache.append(layer, torch.cat([c, k_pe], dim=-1), c)
    o = ops.attention(torch.cat([q_lat, q_pe], dim=-1), keys, values, cache.positions(t, h.device), scale)
    return ops.head_linear(o, m.v_b)  # [T, H, v]
