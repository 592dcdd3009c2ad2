"""DeepSeek-V4 (`deepseek4`, DeepSeek-V4-Flash): a residual of `hc` hyper-connected streams; per
layer an attention block (sliding window, CSA or HCA by `compress_ratios`, see
compressed_attention.py) and a MoE block, each entered and left through a hyper-connection. MoE:
sqrt-softplus scores; the first `hash_layer_count` layers take their experts from a fixed
token-id table (known before the layer runs: registered as static routes in the expert seam), the
others the top-k of the scores plus a correction bias that decides selection only; weights are the
chosen scores renormalized times the routed scale; experts and the shared expert use SwiGLU with
the gate clamped from above and up clamped both ways. Sliding layers use plain RoPE; compressed
layers a YaRN RoPE of their own base with no attention factor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.activation import Activation
from ..nn.compressed_attention import AttentionShape, AttentionWeights, LayerState, attention
from ..nn.hyper_connections import HyperConnection
from ..nn.layers import BatchKV, KVCache, Rope, RopeStyle
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
    head_dim: int
    rope_dim: int
    rope_base: float
    compress_rope_base: float
    rope_factor: float
    rope_original_context: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    eps: float
    window: int
    compress_ratios: list
    o_groups: int
    index_heads: int
    index_dim: int
    index_topk: int
    n_expert_used: int
    weights_scale: float
    n_hash: int
    clamp_exp: list
    clamp_shexp: list
    hc: int
    hc_iters: int
    hc_eps: float


KEYS = {
    "n_layer": Key("block_count"),
    "n_embd": Key("embedding_length"),
    "n_head": Key("attention.head_count"),
    "head_dim": Key("attention.key_length"),
    "rope_dim": Key("rope.dimension_count"),
    "rope_base": Key("rope.freq_base", 10000.0),
    "compress_rope_base": Key("attention.compress_rope_freq_base"),
    "rope_factor": Key("rope.scaling.factor", 1.0),
    "rope_original_context": Key("rope.scaling.original_context_length", 4096),
    "yarn_beta_fast": Key("rope.scaling.yarn_beta_fast", 32.0),
    "yarn_beta_slow": Key("rope.scaling.yarn_beta_slow", 1.0),
    "eps": Key("attention.layer_norm_rms_epsilon"),
    "window": Key("attention.sliding_window"),
    "compress_ratios": Key("attention.compress_ratios"),
    "o_groups": Key("attention.output_group_count"),
    "index_heads": Key("attention.indexer.head_count"),
    "index_dim": Key("attention.indexer.key_length"),
    "index_topk": Key("attention.indexer.top_k"),
    "n_expert_used": Key("expert_used_count"),
    "weights_scale": Key("expert_weights_scale", 1.0),
    "n_hash": Key("hash_layer_count", 0),
    "clamp_exp": Key("swiglu_clamp_exp"),
    "clamp_shexp": Key("swiglu_clamp_shexp"),
    "hc": Key("hyper_connection.count"),
    "hc_iters": Key("hyper_connection.sinkhorn_iterations"),
    "hc_eps": Key("hyper_connection.epsilon"),
}


def _state_bytes_per_position(shape: AttentionShape) -> float:
    """What a position adds to a layer's reserved state: each compressor's entry (one a `ratio`
    positions, float32) and the indexer's tie flag (a byte); the window's raw entries and the
    compressors' pending rows take the same at any length."""
    if not shape.ratio:
        return 0.0
    entries = sum(d for _, d in shape.compressor_shapes().values()) * 4 / shape.ratio
    return entries + (1 if shape.indexed else 0)


def load_hyper_connection(w: dict[str, QTensor], prefix: str, a: Args) -> HyperConnection:
    """The hyper-connection whose tensors are `<prefix>_fn`, `_base` and `_scale`, dequantized once."""
    return HyperConnection(w[prefix + "_fn.weight"].dequant(), w[prefix + "_base.weight"].dequant(),
                           w[prefix + "_scale.weight"].dequant(), a.hc, a.hc_iters, a.hc_eps, a.eps)


@dataclass(frozen=True)
class Router:
    """A MoE block's routing: its logits' matrix, then either the top-k layers' correction bias or
    the hash layers' token-id -> experts table (the first `n_hash` layers)."""
    gate_inp: QTensor  # ffn_gate_inp
    bias: QTensor | None  # exp_probs_b: top-k layers
    table: torch.Tensor | None  # ffn_gate_tid2eid [n_vocab, k] as integers: hash layers

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int, n_hash: int) -> "Router":
        p = f"blk.{layer}."
        hashed = layer < n_hash
        return cls(w[p + "ffn_gate_inp.weight"], None if hashed else w[p + "exp_probs_b.bias"],
                   w[p + "ffn_gate_tid2eid.weight"].ints() if hashed else None)


@dataclass(frozen=True)
class SharedExpert:
    """The MoE block's shared expert: a SwiGLU with its own clamp."""
    gate: QTensor  # ffn_gate_shexp
    up: QTensor  # ffn_up_shexp
    down: QTensor  # ffn_down_shexp
    act: Activation

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int, limit: float) -> "SharedExpert":
        p = f"blk.{layer}."
        return cls(w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"],
                   Activation(limit=limit))


@dataclass(frozen=True)
class Layer:
    """One layer's trunk tensors by role, resolved from their GGUF names once at load: each block's
    hyper-connection and input norm, the attention, the MoE block's router and shared expert."""
    hc_attn: HyperConnection
    attn_norm: QTensor
    attn: AttentionWeights
    hc_ffn: HyperConnection
    ffn_norm: QTensor
    router: Router
    shexp: SharedExpert

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, a: Args) -> "Layer":
        p = f"blk.{i}."
        return cls(load_hyper_connection(w, p + "hc_attn", a), w[p + "attn_norm.weight"],
                   AttentionWeights.load(w, i, int(a.compress_ratios[i])), load_hyper_connection(w, p + "hc_ffn", a),
                   w[p + "ffn_norm.weight"], Router.load(w, i, a.n_hash),
                   SharedExpert.load(w, i, float(a.clamp_shexp[i])))


class Model:
    static_decode = True  # once reserved, the compressed-attention states are buffers updated in place
    batched_decode = True  # forward takes a BatchKV: each row's attention in its own sequence's states
    static_prompt = True  # a short prompt too: its compressors complete the windows it fills (_compress_pass)

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        a = self.args = read_args(Args, files.arch, files.metadata, KEYS)
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.place, self.device, self.ops = place, place.first, place.ops
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.output_norm = w["output_norm.weight"]
        self.main_rope = Rope(a.rope_dim, a.rope_base, RopeStyle.NORM)
        self.compress_rope = Rope(a.rope_dim, a.compress_rope_base, RopeStyle.NORM, a.rope_factor,
                                  a.rope_original_context, a.yarn_beta_fast, a.yarn_beta_slow)  # no mscale
        self.layers = [Layer.load(w, i, a) for i in range(a.n_layer)]
        self.shapes = [AttentionShape(a.n_head, a.head_dim, a.window, int(a.compress_ratios[i]), a.o_groups,
                                      a.index_heads, a.index_dim, a.index_topk, a.eps,
                                      overlap=layer.attn.compressor is not None and layer.attn.compressor.overlapping,
                                      indexed=layer.attn.indexer is not None) for i, layer in enumerate(self.layers)]
        self.hc_head = load_hyper_connection(w, "output_hc", a)
        self.kv_position_bytes = tuple(_state_bytes_per_position(shape) for shape in self.shapes)  # by layer
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files),
                             [Activation(limit=float(c)) for c in a.clamp_exp])
        self.moe.static_routes.update({i: layer.router.table for i, layer in enumerate(self.layers)
                                       if layer.router.table is not None})
        self.moe.router = self.route

    def new_states(self) -> dict[int, LayerState]:
        """Every layer's state before a first token, shaped by the weights: an empty cache reserves
        these for a static prompt, whose graph then reads and writes the same buffers as the
        decode step's. On the first device: static prompts run on workers of one device only."""
        return {i: LayerState(shape, self.device) for i, shape in enumerate(self.shapes)}

    def forward(self, tokens: torch.Tensor, cache: KVCache | BatchKV, last: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens [T] -> logits [T, n_vocab]; appends to the cache. With a BatchKV the tokens are
        several sequences' (runs of them, BatchKV.counts): the attention runs run by run, each over its own sequence's
        compressed states and window, as that sequence's own step does; the hyper-connections,
        the shared expert and the routed experts (a layer's experts read once for the union of
        the rows' picks) on every row at once."""
        ops = self.ops
        a = self.args
        x = ops.rows(self.token_embd, tokens)  # [T, D]
        streams = x[:, None, :].expand(-1, a.hc, -1).contiguous()
        self.moe.begin(tokens)
        runs = None
        if isinstance(cache, BatchKV):
            cache.bound(len(tokens))  # the runs' tokens, or ValueError
            runs = cache.segments()
        for i, layer in enumerate(self.layers):
            streams, tokens = self.place.hop(i, streams, tokens)
            pre, post, comb = layer.hc_attn.weights(ops, streams)
            h = layer.hc_attn.block_input(ops, streams, pre, ops.dequant(layer.attn_norm))
            if runs is not None:
                out = torch.cat([self._attention(i, h[r], c) for c, r in runs])
            else:
                out = self._attention(i, h, cache)
            streams = ops.hc_expand(streams, out, post, comb)

            pre, post, comb = layer.hc_ffn.weights(ops, streams)
            h = layer.hc_ffn.block_input(ops, streams, pre, ops.dequant(layer.ffn_norm))
            streams = ops.hc_expand(streams, self._moe(i, h, tokens), post, comb)
        cache.advance(len(tokens))
        x = ops.rms_norm(self.hc_head.head(ops, streams), ops.dequant(self.output_norm), a.eps)
        return ops.output_logits(x, self.output, last)

    def _attention(self, i: int, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Layer i's attention of h [T, D] at the cache's next positions, over its state there."""
        state = cache.state.setdefault(i, LayerState(self.shapes[i]))
        rope = self.compress_rope if self.shapes[i].ratio else self.main_rope
        start = cache.length if cache.step_positions is None else cache.positions(h.shape[0], h.device)
        return attention(self.ops, self.layers[i].attn, h, start, state, rope)

    def _moe(self, i: int, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        layer = self.layers[i]
        if layer.router.table is not None:
            logits = ops.linear(h, layer.router.gate_inp)
            ids, weights = ops.sqrtsoftplus_hashed(logits, layer.router.table, tokens, self.args.weights_scale)
        else:
            ids, weights = self.route(i, h)
        routed = self.moe(i, h, ids, weights)
        shexp = layer.shexp
        return routed + ops.linear(shexp.act(ops.linear(h, shexp.gate), ops.linear(h, shexp.up)), shexp.down)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A top-k layer's routing (hash layers route by token id, in _moe)."""
        ops = self.ops
        router = self.layers[i].router
        return ops.sqrtsoftplus_topk(ops.linear(h, router.gate_inp), ops.dequant(router.bias),
                                     self.args.n_expert_used, self.args.weights_scale)
