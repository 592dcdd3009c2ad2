"""Qwen1.5-MoE / Qwen2-MoE (`qwen2moe`): pre-norm decoder; GQA with q/k/v biases and NEOX RoPE; every
layer an MoE of SwiGLU experts routed by softmax top-k without renormalization, plus a shared expert
whose output is scaled by a sigmoid gate computed from the same input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..nn.gqa import GqaWeights, gqa_attention, kv_bytes_per_position
from ..nn.layers import KVCache, Rope, RopeStyle
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..weights.model_files import ModelFiles, expert_count
from ..weights.qtensor import QTensor
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


@dataclass(frozen=True)
class Layer:
    """One block's trunk tensors, resolved from their GGUF names at load."""
    attn_norm: QTensor
    attn: GqaWeights
    ffn_norm: QTensor
    router: QTensor  # ffn_gate_inp
    shared_gate: QTensor  # the shared expert's SwiGLU: ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp
    shared_up: QTensor
    shared_down: QTensor
    shared_router: QTensor  # ffn_gate_inp_shexp: the sigmoid gate on the shared expert's output

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int) -> "Layer":
        p = f"blk.{i}."
        return cls(w[p + "attn_norm.weight"], GqaWeights.load(w, i), w[p + "ffn_norm.weight"],
                   w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                   w[p + "ffn_down_shexp.weight"], w[p + "ffn_gate_inp_shexp.weight"])


class Model:
    static_decode = True  # a one-token step has the same shapes at every position (a CUDA graph can replay it)
    batched_decode = True  # forward takes a BatchKV: several sequences' next tokens in one step (gqa.py)
    static_prompt = True  # a short prompt too (no state but the KV cache): a CUDA graph per prompt length

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        self.head_dim = a.n_embd // a.n_head
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.output_norm = w["output_norm.weight"]
        self.layers = [Layer.load(w, i) for i in range(a.n_layer)]
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files))
        self.moe.router = self.route
        self.rope = Rope(self.head_dim, a.rope_base, RopeStyle.NEOX)
        self.kv_position_bytes = (kv_bytes_per_position(a.n_head_kv, self.head_dim),) * a.n_layer  # by layer
        self.place, self.device, self.ops = place, place.first, place.ops

    def shared_expert(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        y = ops.linear(F.silu(ops.linear(h, layer.shared_gate)) * ops.linear(h, layer.shared_up), layer.shared_down)
        gate = h @ ops.dequant(layer.shared_router).reshape(-1, 1)  # [T, 1]
        return torch.sigmoid(gate) * y

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        ops = self.ops
        a, hd, t = self.args, self.head_dim, len(tokens)
        x = ops.rows(self.token_embd, tokens)
        cos, sin = self.rope.at(cache.positions(t, self.device), cache.bound(t))
        for i, layer in enumerate(self.layers):
            x, cos, sin = self.place.hop(i, x, cos, sin)
            h = ops.rms_norm(x, ops.dequant(layer.attn_norm), a.eps)
            x = x + gqa_attention(ops, layer.attn, h, i, cache, a.n_head, a.n_head_kv, hd, self.rope, cos, sin, a.eps)
            h = ops.rms_norm(x, ops.dequant(layer.ffn_norm), a.eps)
            ids, weights = self.route(i, h)
            x = x + self.moe(i, h, ids, weights) + self.shared_expert(layer, h)
        cache.advance(t)
        return ops.output_logits(ops.rms_norm(x, ops.dequant(self.output_norm), a.eps), self.output, last)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        return ops.softmax_topk(ops.linear(h, self.layers[i].router), self.args.n_expert_used, normalize=False)
