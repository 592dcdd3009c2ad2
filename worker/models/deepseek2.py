"""DeepSeek-V2/V3/R1 and Kimi-K2 (`deepseek2`): multi-head latent attention (q and kv through LoRA
ranks, a decoupled RoPE part shared by all heads, keys and values expanded per head from the
compressed kv by the converter's split attn_k_b / attn_v_b), leading dense layers, then MoE layers:
sigmoid scores with a correction bias that decides selection only, group-limited top-k,
renormalized, times the routed scaling factor, plus always-on shared experts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..nn.layers import KVCache, Rope, RopeStyle
from ..nn.mla import MlaWeights, absorbed_attention, mla_keys_values, mla_query
from ..nn.moe import ExpertFFN
from ..nn.ops import TorchOps
from ..nn.placement import Placement
from ..nn.routing import sigmoid_group_topk
from ..weights.model_files import ModelFiles, expert_count
from ..weights.qtensor import QTensor
from .config import Key, read_args

GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # {arch}.expert_gating_func; absent means softmax (DeepSeek-V2)


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_embd: int
    n_head: int
    n_expert_used: int
    n_dense: int
    kv_lora: int
    key_mla: int  # per-head query/key width: nope + rope
    value_mla: int
    rope_dim: int
    rope_base: float
    eps: float
    n_group: int
    topk_group: int
    gating: int
    weights_norm: bool
    weights_scale: float
    rope_factor: float
    rope_original_context: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_log_multiplier: float


KEYS = {
    "n_layer": Key("block_count"),
    "n_embd": Key("embedding_length"),
    "n_head": Key("attention.head_count"),
    "n_expert_used": Key("expert_used_count"),
    "n_dense": Key("leading_dense_block_count", 0),
    "kv_lora": Key("attention.kv_lora_rank"),
    "key_mla": Key("attention.key_length_mla"),
    "value_mla": Key("attention.value_length_mla"),
    "rope_dim": Key("rope.dimension_count"),
    "rope_base": Key("rope.freq_base", 10000.0),
    "eps": Key("attention.layer_norm_rms_epsilon"),
    "n_group": Key("expert_group_count", 1),
    "topk_group": Key("expert_group_used_count", 1),
    "gating": Key("expert_gating_func", GATING_SOFTMAX),
    "weights_norm": Key("expert_weights_norm", False),
    "weights_scale": Key("expert_weights_scale", 1.0),
    "rope_factor": Key("rope.scaling.factor", 1.0),
    "rope_original_context": Key("rope.scaling.original_context_length", 4096),
    "yarn_beta_fast": Key("rope.scaling.yarn_beta_fast", 32.0),
    "yarn_beta_slow": Key("rope.scaling.yarn_beta_slow", 1.0),
    "yarn_log_multiplier": Key("rope.scaling.yarn_log_multiplier", 0.0),
}


@dataclass(frozen=True)
class SwiGLU:
    """A dense SwiGLU FFN's three matrices: a leading dense layer's, or the shared experts'."""
    gate: QTensor
    up: QTensor
    down: QTensor

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, suffix: str = "") -> "SwiGLU":
        p = f"blk.{i}."
        return cls(w[f"{p}ffn_gate{suffix}.weight"], w[f"{p}ffn_up{suffix}.weight"], w[f"{p}ffn_down{suffix}.weight"])

    def __call__(self, ops: TorchOps, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(F.silu(ops.linear(x, self.gate)) * ops.linear(x, self.up), self.down)


@dataclass(frozen=True)
class Layer:
    """One block's trunk tensors, resolved from their GGUF names at load. A leading dense layer has
    `dense`; an MoE layer has `router` (with `router_bias` under sigmoid gating) and, where the
    GGUF has them, the shared experts."""
    attn_norm: QTensor
    attn: MlaWeights
    ffn_norm: QTensor
    dense: SwiGLU | None = None
    router: QTensor | None = None  # ffn_gate_inp
    router_bias: QTensor | None = None  # exp_probs_b: the correction bias that decides selection only
    shared: SwiGLU | None = None

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, a: Args) -> "Layer":
        p = f"blk.{i}."
        common = w[p + "attn_norm.weight"], MlaWeights.load(w, i), w[p + "ffn_norm.weight"]
        if i < a.n_dense:
            return cls(*common, dense=SwiGLU.load(w, i))
        bias = w[p + "exp_probs_b.bias"] if a.gating == GATING_SIGMOID else None
        shared = SwiGLU.load(w, i, "_shexp") if p + "ffn_gate_shexp.weight" in w else None
        return cls(*common, router=w[p + "ffn_gate_inp.weight"], router_bias=bias, shared=shared)


class Model:
    static_decode = True  # a one-token step has the same shapes at every position (a CUDA graph can replay it)
    static_prompt = True  # a short prompt too (no state but the KV cache): a CUDA graph per prompt length

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        self.nope = a.key_mla - a.rope_dim
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.output_norm = w["output_norm.weight"]
        self.layers = [Layer.load(w, i, a) for i in range(a.n_layer)]
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files))
        self.moe.router = self.route
        # DeepSeek's YaRN scales attention by mscale^2 through the softmax scale, and leaves cos/sin
        # alone (its mscale equals mscale_all_dim). The GGUF stores 0.1 * mscale_all_dim.
        mscale = a.yarn_log_multiplier * math.log(a.rope_factor) + 1.0 if a.rope_factor > 1 else 1.0
        self.scale = a.key_mla ** -0.5 * mscale * mscale
        self.rope = Rope(a.rope_dim, a.rope_base, RopeStyle.NORM, a.rope_factor, a.rope_original_context,
                         a.yarn_beta_fast, a.yarn_beta_slow)
        self.place, self.device, self.ops = place, place.first, place.ops

    def attention(self, layer: Layer, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: KVCache) -> torch.Tensor:
        ops = self.ops
        a, m, t = self.args, layer.attn, len(h)
        q = mla_query(ops, m, h, a.n_head, a.key_mla, a.eps)
        if ops.kernels:
            o = absorbed_attention(ops, m, h, q, i, cache, a.kv_lora, self.nope, a.eps, self.scale,
                                   lambda x: ops.rope(x, self.rope, cos, sin))
            return ops.linear(o.reshape(t, -1), m.output)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        k_nope, k_pe, value = mla_keys_values(ops, m, h, a.kv_lora, a.eps)  # k_pe: one rotary key for every head
        q_pe, k_pe = ops.rope(q_pe, self.rope, cos, sin), ops.rope(k_pe, self.rope, cos, sin)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(t, a.n_head, a.rope_dim)], dim=-1)
        key, value = cache.append(i, key, value)
        o = ops.attention(query, key, value, cache.positions(t, query.device), self.scale).reshape(t, -1)
        return ops.linear(o, m.output)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        a, layer = self.args, self.layers[i]
        logits = ops.linear(h.to(torch.float32), layer.router)
        if a.gating == GATING_SIGMOID:
            return sigmoid_group_topk(logits, ops.dequant(layer.router_bias), a.n_expert_used, a.n_group,
                                      a.topk_group, a.weights_norm, a.weights_scale)
        ids, weights = ops.softmax_topk(logits, a.n_expert_used, a.weights_norm)
        return ids, weights * a.weights_scale

    def ffn(self, layer: Layer, i: int, h: torch.Tensor) -> torch.Tensor:
        if layer.dense is not None:
            return layer.dense(self.ops, h)
        ids, weights = self.route(i, h)
        out = self.moe(i, h, ids, weights)
        if layer.shared is not None:
            out = out + layer.shared(self.ops, h)
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        ops = self.ops
        a, t = self.args, len(tokens)
        x = ops.rows(self.token_embd, tokens)
        cos, sin = self.rope.at(cache.positions(t, self.device), cache.bound(t))
        for i, layer in enumerate(self.layers):
            x, cos, sin = self.place.hop(i, x, cos, sin)
            x = x + self.attention(layer, i, ops.rms_norm(x, ops.dequant(layer.attn_norm), a.eps), cos, sin, cache)
            x = x + self.ffn(layer, i, ops.rms_norm(x, ops.dequant(layer.ffn_norm), a.eps))
        cache.advance(t)
        return ops.output_logits(ops.rms_norm(x, ops.dequant(self.output_norm), a.eps), self.output, last)
