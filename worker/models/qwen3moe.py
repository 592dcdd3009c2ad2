"""Qwen3-MoE (`qwen3moe`): pre-norm decoder; GQA with per-head RMSNorm on q and k and NEOX RoPE;
every layer an MoE of SwiGLU experts routed by softmax top-k, renormalized (llama.cpp's qwen3moe
graph always renormalizes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.gqa import GqaMoeLayer, gqa_attention, kv_bytes_per_position
from ..nn.layers import KVCache, Rope, RopeStyle
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..weights.model_files import ModelFiles, expert_count
from .config import Key, read_args


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


KEYS = {
    "n_layer": Key("block_count"),
    "n_embd": Key("embedding_length"),
    "n_head": Key("attention.head_count"),
    "n_head_kv": Key("attention.head_count_kv"),
    "head_dim": Key("attention.key_length"),
    "n_expert_used": Key("expert_used_count"),
    "rope_base": Key("rope.freq_base", 10000.0),
    "eps": Key("attention.layer_norm_rms_epsilon"),
}


class Model:
    static_decode = True  # a one-token step has the same shapes at every position (a CUDA graph can replay it)
    batched_decode = True  # forward takes a BatchKV: several sequences' next tokens in one step (gqa.py)
    static_prompt = True  # a short prompt too (no state but the KV cache): a CUDA graph per prompt length

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = read_args(Args, files.arch, files.metadata, KEYS)
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.first_norm = w["blk.0.attn_norm.weight"]
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files))
        self.moe.router = self.route
        self.rope = Rope(self.args.head_dim, self.args.rope_base, RopeStyle.NEOX)
        self.kv_position_bytes = (kv_bytes_per_position(self.args.n_head_kv, self.args.head_dim),) * self.args.n_layer
        self.place, self.device, self.ops = place, place.first, place.ops
        self.layers = [GqaMoeLayer.load(w, i, self.args.n_layer, place) for i in range(self.args.n_layer)]

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens [T] -> logits [T, n_vocab]; appends to the cache."""
        ops = self.ops
        a = self.args
        x = ops.rows(self.token_embd, tokens)  # [T, D]
        cos, sin = self.rope.at(cache.positions(len(tokens), self.device), cache.bound(len(tokens)))
        h = ops.rms_norm(x, ops.dequant(self.first_norm), a.eps)
        for i, layer in enumerate(self.layers):
            x, h, cos, sin = self.place.hop(i, x, h, cos, sin)
            attn = gqa_attention(ops, layer.attn, h, i, cache, a.n_head, a.n_head_kv, a.head_dim, self.rope, cos, sin,
                                 a.eps, parts=True)
            x, h = ops.add_rms_norm(x, attn, ops.dequant(layer.ffn_norm), a.eps)
            ids, weights = self.route(i, h)
            x, h = ops.add_rms_norm(x, self.moe(i, h, ids, weights, summed=False), ops.dequant(layer.norm_after), a.eps)
        cache.advance(len(tokens))
        return ops.output_logits(h, self.output, last)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        return ops.softmax_topk(ops.linear_parts(h, self.layers[i].router), self.args.n_expert_used, normalize=True)
