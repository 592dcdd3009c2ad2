"""The grouped-query attention block llama.cpp's GGUFs share (Qwen2/3-MoE, Mixtral, gpt-oss):
attn_q/k/v (with biases where the GGUF has them), per-head attn_q_norm/attn_k_norm where present
(Qwen3), RoPE, the KV cache, attn_sinks where present (gpt-oss), attn_output (+ bias).

GqaWeights resolves one layer's tensors from their GGUF names once, at load; the forward pass reads
attributes. q, k and v are stacked there into one matrix (their biases into one vector) where they
can be, the three then views of its bytes: nothing is held twice, and the fast path multiplies them
in one launch. The torch path reads the same bytes through the views, so its bits do not change."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..weights.qtensor import QTensor, stacked_rows
from .layers import BatchKV, KVCache, Rope, RopeStyle
from .ops import TorchOps

if TYPE_CHECKING:
    from .triton_ops import TritonOps
from .placement import Placement


def kv_bytes_per_position(n_head_kv: int, head_dim: int) -> int:
    """Bytes a layer's keys and values take a position in the KV cache: float32, as the passes
    write them (a key and a value of n_head_kv x head_dim)."""
    return 2 * n_head_kv * head_dim * 4


@dataclass(frozen=True)
class GqaWeights:
    q: QTensor
    k: QTensor
    v: QTensor
    output: QTensor
    q_bias: QTensor | None = None
    k_bias: QTensor | None = None
    v_bias: QTensor | None = None
    output_bias: QTensor | None = None
    q_norm: QTensor | None = None  # per head, with k_norm (Qwen3)
    k_norm: QTensor | None = None
    sinks: QTensor | None = None  # a logit per head (gpt-oss)
    qkv: QTensor | None = None  # q, k and v stacked (None: their types or row lengths differ)
    qkv_bias: QTensor | None = None

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int) -> "GqaWeights":
        """Layer `layer`'s attention from the trunk's tensors by name. Where q/k/v stack, `w`'s
        entries become views of the stacked bytes too, so the trunk holds them once."""
        p = f"blk.{layer}."
        found = {field: w.get(p + name) for field, name in _NAMES.items()}
        weights = [found["q"], found["k"], found["v"]]
        biases = [found["q_bias"], found["k_bias"], found["v_bias"]]
        qkv = stacked_rows(p + "attn_qkv.weight", weights)
        qkv_bias = None
        if qkv is not None and biases != [None] * 3:
            qkv_bias = None if None in biases else stacked_rows(p + "attn_qkv.bias", biases)
            if qkv_bias is None:  # biases on some of q/k/v only, or of other types: not stacked
                qkv = None
        for whole, names in ((qkv, ("q", "k", "v")), (qkv_bias, ("q_bias", "k_bias", "v_bias"))):
            if whole is None:
                continue
            start = 0
            for name in names:
                part = found[name]
                found[name] = w[part.name] = replace(part, raw=whole.raw[start:start + part.raw.numel()])
                start += part.raw.numel()
        return cls(**found, qkv=qkv, qkv_bias=qkv_bias)


@dataclass(frozen=True)
class GqaMoeLayer:
    """A pre-norm block of this attention, then routed experts, whose next block's input norm is
    fused into its residual add (Qwen3-MoE, Mixtral, gpt-oss): its trunk tensors by role."""
    attn: GqaWeights
    ffn_norm: QTensor  # the experts' input norm (gpt-oss calls it post_attention_norm)
    router: QTensor  # ffn_gate_inp
    router_bias: QTensor | None
    norm_after: QTensor  # the next block's attn_norm (output_norm after the last), on this block's device

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, n_layer: int, place: Placement,
             ffn_norm: str = "ffn_norm") -> "GqaMoeLayer":
        p = f"blk.{i}."
        after = w[f"blk.{i + 1}.attn_norm.weight" if i + 1 < n_layer else "output_norm.weight"]
        return cls(GqaWeights.load(w, i), w[f"{p}{ffn_norm}.weight"], w[p + "ffn_gate_inp.weight"],
                   w.get(p + "ffn_gate_inp.bias"), place.on_layer(i, after))


_NAMES = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "output": "attn_output.weight",
          "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
          "output_bias": "attn_output.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
          "sinks": "attn_sinks.weight"}


def gqa_attention(ops: TorchOps, a: GqaWeights, h: torch.Tensor, layer: int, cache: KVCache | BatchKV, n_head: int,
                  n_head_kv: int, head_dim: int, rope: Rope, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  window: int | None = None, parts: bool = False) -> torch.Tensor:
    """h [T, D] -> [T, D]; with `parts`, a decode step on the fast path may answer [T, S, D],
    partial sums for add_rms_norm. With a BatchKV the rows are several sequences' tokens: the
    projections run on all of them, the cache writes and the attention run by run (BatchKV.counts),
    each in its own sequence's cache."""
    rows = [(cache, slice(None))] if not isinstance(cache, BatchKV) else cache.segments()
    if a.qkv is not None and ops.kernels and h.dtype == torch.float32:
        o = _fused_gqa(ops, a, h, layer, rows, n_head, n_head_kv, head_dim, rope, cos, sin, eps, window)
        if parts and a.output_bias is None:
            return ops.linear_parts(o, a.output)
        return ops.linear(o, a.output, a.output_bias)
    t = h.shape[0]
    q = ops.linear(h, a.q, a.q_bias).reshape(t, n_head, head_dim)
    k = ops.linear(h, a.k, a.k_bias).reshape(t, n_head_kv, head_dim)
    v = ops.linear(h, a.v, a.v_bias).reshape(t, n_head_kv, head_dim)
    if a.q_norm is not None:
        q = ops.rms_norm(q, ops.dequant(a.q_norm), eps)
        k = ops.rms_norm(k, ops.dequant(a.k_norm), eps)
    q, k = ops.rope(q, rope, cos, sin), ops.rope(k, rope, cos, sin)
    sinks = ops.dequant(a.sinks) if a.sinks is not None else None
    out = []
    for c, r in rows:
        keys, values = c.append(layer, k[r], v[r])
        out.append(ops.attention(q[r], keys, values, c.positions(q[r].shape[0], q.device), head_dim ** -0.5,
                                 window=window, sinks=sinks))
    o = out[0] if len(out) == 1 else torch.cat(out)
    return ops.linear(o.reshape(t, -1), a.output, a.output_bias)


def _fused_gqa(ops: TritonOps, a: GqaWeights, h: torch.Tensor, layer: int, rows: list[tuple[KVCache, slice]],
               n_head: int, n_head_kv: int, head_dim: int, rope: Rope, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               window: int | None) -> torch.Tensor:
    """gqa_attention on the fast path up to the output projection (attention's output [T, H * d]):
    one launch for q/k/v, then for each sequence's rows one for their norms, RoPE and the cache
    write, and two for attention."""
    t = h.shape[0]
    qkv = ops.linear(h, a.qkv, a.qkv_bias) if a.qkv_bias is not None else ops.linear_parts(h, a.qkv)
    shape = torch.Size((n_head_kv, head_dim))
    q_norm = ops.dequant(a.q_norm) if a.q_norm is not None else None
    k_norm = ops.dequant(a.k_norm) if q_norm is not None else None
    sinks = ops.dequant(a.sinks) if a.sinks is not None else None
    out = []
    for c, r in rows:
        n = qkv[r].shape[0]
        keys, values, seen = c.buffers(layer, n, shape, shape, qkv)
        positions = c.positions(n, h.device)
        q = ops.qkv_rope_store(qkv[r], n_head, n_head_kv, q_norm, k_norm, eps, cos[r], sin[r], rope.dim,
                               rope.style is RopeStyle.NEOX, keys, values, positions)
        out.append(ops.attention(q, keys[:seen], values[:seen], positions, head_dim ** -0.5, window=window,
                                 sinks=sinks))
    o = out[0] if len(out) == 1 else torch.cat(out)
    return o.reshape(t, -1)
