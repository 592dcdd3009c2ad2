"""Qwen1.5-MoE / Qwen2-MoE (`qwen2moe`): pre-norm decoder; GQA with q/k/v biases and NEOX RoPE; every
layer an MoE of SwiGLU experts routed by softmax top-k without renormalization, plus a shared expert
whose output is scaled by a sigmoid gate computed from the same input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..nn.layers import KVCache, Rope, RopeStyle, gqa_attention, output_logits, rms_norm
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..nn.routing import softmax_topk
from ..weights.model_files import ModelFiles, expert_count
from ..weights.qtensor import linear
from .config import Key, read_args


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_expert_used: int
    rope_base: float
    eps: float


KEYS = {
    "n_layer": Key("block_count"),
    "n_embd": Key("embedding_length"),
    "n_head": Key("attention.head_count"),
    "n_head_kv": Key("attention.head_count_kv"),
    "n_expert_used": Key("expert_used_count"),
    "rope_base": Key("rope.freq_base", 10000.0),
    "eps": Key("attention.layer_norm_rms_epsilon"),
}


class Model:
    static_decode = True  # a one-token step has the same shapes at every position (a CUDA graph can replay it)
    static_prompt = True  # a short prompt too (no state but the KV cache): a CUDA graph per prompt length

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        self.head_dim = a.n_embd // a.n_head
        self.w = place.weights(files.trunk)
        self.moe = ExpertFFN(files.experts, expert_count(files))
        self.moe.router = self.route
        self.rope = Rope(self.head_dim, a.rope_base, RopeStyle.NEOX)
        self.place, self.device = place, place.first

    def shared_expert(self, p: str, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        y = linear(F.silu(linear(h, w[p + "ffn_gate_shexp.weight"])) * linear(h, w[p + "ffn_up_shexp.weight"]),
                   w[p + "ffn_down_shexp.weight"])
        gate = h @ w[p + "ffn_gate_inp_shexp.weight"].dequant().reshape(-1, 1)  # [T, 1]
        return torch.sigmoid(gate) * y

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: bool = False) -> torch.Tensor:
        a, w, hd, t = self.args, self.w, self.head_dim, len(tokens)
        x = w["token_embd.weight"].rows(tokens)
        cos, sin = self.rope.at(cache.positions(t, self.device), cache.bound(t))
        for i in range(a.n_layer):
            p = f"blk.{i}."
            x, cos, sin = self.place.hop(i, x, cos, sin)
            h = rms_norm(x, w[p + "attn_norm.weight"].dequant(), a.eps)
            x = x + gqa_attention(w, p, h, i, cache, a.n_head, a.n_head_kv, hd, self.rope, cos, sin, a.eps)
            h = rms_norm(x, w[p + "ffn_norm.weight"].dequant(), a.eps)
            ids, weights = self.route(i, h)
            x = x + self.moe(i, h, ids, weights) + self.shared_expert(p, h)
        cache.length += t
        return output_logits(rms_norm(x, w["output_norm.weight"].dequant(), a.eps), w["output.weight"], last)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(linear(h, self.w[f"blk.{i}.ffn_gate_inp.weight"]), self.args.n_expert_used, normalize=False)
