"""gpt-oss (`gpt-oss`): pre-norm decoder; GQA with biases, a learned attention sink per head, NEOX
RoPE with YaRN (untruncated correction range, as gpt-oss configures it), sliding-window attention on
even layers and full attention on odd ones; an MoE on every layer routed by top-k then softmax, whose
experts carry biases and use the clamped SwiGLU (alpha 1.702, limit 7) and are MXFP4 in the
released checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.activation import Activation, ActKind
from ..nn.gqa import GqaMoeLayer, gqa_attention, kv_bytes_per_position
from ..nn.layers import KVCache, Rope, RopeStyle
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..weights.model_files import ModelFiles, expert_count
from .config import Key, read_args

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert_used: int
    rope_base: float
    eps: float
    sliding_window: int
    rope_factor: float
    rope_original_context: int
    yarn_beta_fast: float
    yarn_beta_slow: float


KEYS = {
    "n_layer": Key("block_count"),
    "n_embd": Key("embedding_length"),
    "n_head": Key("attention.head_count"),
    "n_head_kv": Key("attention.head_count_kv"),
    "head_dim": Key("attention.key_length"),
    "n_expert_used": Key("expert_used_count"),
    "rope_base": Key("rope.freq_base"),
    "eps": Key("attention.layer_norm_rms_epsilon"),
    "sliding_window": Key("attention.sliding_window"),
    "rope_factor": Key("rope.scaling.factor", 1.0),
    "rope_original_context": Key("rope.scaling.original_context_length", 4096),
    "yarn_beta_fast": Key("rope.scaling.yarn_beta_fast", 32.0),
    "yarn_beta_slow": Key("rope.scaling.yarn_beta_slow", 1.0),
}


class Model:
    static_decode = True  # a one-token step has the same shapes at every position (a CUDA graph can replay it)
    batched_decode = True  # forward takes a BatchKV: several sequences' next tokens in one step (gqa.py)
    static_prompt = True  # a short prompt too (no state but the KV cache): a CUDA graph per prompt length

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.first_norm = w["blk.0.attn_norm.weight"]
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files), Activation(ActKind.SWIGLU_OAI, limit=SWIGLU_LIMIT, alpha=SWIGLU_ALPHA))
        self.moe.router = self.route
        self.rope = Rope(a.head_dim, a.rope_base, RopeStyle.NEOX, a.rope_factor, a.rope_original_context,
                         a.yarn_beta_fast, a.yarn_beta_slow, truncate=False, mscale=Rope.yarn_mscale(a.rope_factor))
        self.kv_position_bytes = (kv_bytes_per_position(a.n_head_kv, a.head_dim),) * a.n_layer  # by layer
        self.place, self.device, self.ops = place, place.first, place.ops
        self.layers = [GqaMoeLayer.load(w, i, a.n_layer, place, ffn_norm="post_attention_norm")
                       for i in range(a.n_layer)]

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        ops = self.ops
        a, hd, t = self.args, self.args.head_dim, len(tokens)
        x = ops.rows(self.token_embd, tokens)
        cos, sin = self.rope.at(cache.positions(t, self.device), cache.bound(t))
        h = ops.rms_norm(x, ops.dequant(self.first_norm), a.eps)
        for i, layer in enumerate(self.layers):
            x, h, cos, sin = self.place.hop(i, x, h, cos, sin)
            window = a.sliding_window if i % 2 == 0 else None  # sliding on even layers, full on odd
            attn = gqa_attention(ops, layer.attn, h, i, cache, a.n_head, a.n_head_kv, hd, self.rope, cos, sin, a.eps,
                                 window, parts=True)
            x, h = ops.add_rms_norm(x, attn, ops.dequant(layer.ffn_norm), a.eps)
            ids, weights = self.route(i, h)
            x, h = ops.add_rms_norm(x, self.moe(i, h, ids, weights, summed=False), ops.dequant(layer.norm_after), a.eps)
        cache.advance(t)
        return ops.output_logits(h, self.output, last)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        layer = self.layers[i]
        return ops.topk_softmax(ops.linear(h, layer.router, layer.router_bias), self.args.n_expert_used)
