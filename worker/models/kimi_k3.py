"""Kimi-K3 (`kimi-k3`): a hybrid of Kimi Delta Attention layers (recurrent, kda.py) and gated MLA
layers without positional encoding (those with a KV head: `attention.head_count_kv[i] = 1`), under
attention residuals: every `attn_res.block_size` layers the raw residual is banked as a checkpoint
and the residual restarts from the attention output; each block's input is a softmax mix of the
checkpoints and the current residual, scored on their RMS-normalized values against the block's
`*_res_score` vector. Leading dense layers use the situ MLP; the others a latent MoE: the router
scores the full-width input (sigmoid, correction bias for selection only, renormalized, scaled),
the experts run on a down-projected latent input, their sum is normalized and projected back up,
and full-width shared experts are added."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.activation import Activation, ActKind
from ..nn.kda import KdaWeights, kda
from ..nn.layers import KVCache
from ..nn.mla import MlaWeights, absorbed_attention, mla_keys_values, mla_query
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..nn.routing import sigmoid_group_topk
from ..weights.model_files import ModelFiles, expert_count
from ..weights.qtensor import QTensor
from .config import Key, read_args


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_head: int
    kv_heads: list
    n_expert_used: int
    n_dense: int
    kv_lora: int
    key_mla: int
    value_mla: int
    rope_dim: int
    eps: float
    weights_norm: bool
    weights_scale: float
    situ_beta: float
    situ_linear_beta: float
    res_block: int
    kda_head_dim: int
    kda_lower_bound: float


KEYS = {
    "n_layer": Key("block_count"),
    "n_head": Key("attention.head_count"),
    "kv_heads": Key("attention.head_count_kv"),
    "n_expert_used": Key("expert_used_count"),
    "n_dense": Key("leading_dense_block_count", 0),
    "kv_lora": Key("attention.kv_lora_rank"),
    "key_mla": Key("attention.key_length_mla"),
    "value_mla": Key("attention.value_length_mla"),
    "rope_dim": Key("rope.dimension_count"),
    "eps": Key("attention.layer_norm_rms_epsilon"),
    "weights_norm": Key("expert_weights_norm", False),
    "weights_scale": Key("expert_weights_scale", 1.0),
    "situ_beta": Key("activation.situ_beta"),
    "situ_linear_beta": Key("activation.situ_linear_beta", 0.0),
    "res_block": Key("attn_res.block_size"),
    "kda_head_dim": Key("kda.head_dim"),
    "kda_lower_bound": Key("kda.gate_lower_bound", float("-inf")),
}


@dataclass(frozen=True)
class Mlp:
    """A dense situ MLP's three matrices: a leading dense layer's, or the shared experts'."""
    gate: QTensor
    up: QTensor
    down: QTensor

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, suffix: str = "") -> "Mlp":
        p = f"blk.{i}."
        return cls(w[f"{p}ffn_gate{suffix}.weight"], w[f"{p}ffn_up{suffix}.weight"], w[f"{p}ffn_down{suffix}.weight"])


@dataclass(frozen=True)
class LatentMoe:
    """An MoE layer's trunk tensors: the router on the full-width input, the projections into and
    out of the experts' latent width (with the norm between, where the GGUF has one), the shared
    experts where it has them."""
    router: QTensor  # ffn_gate_inp
    router_bias: QTensor  # exp_probs_b: the correction bias that decides selection only
    down: QTensor  # ffn_routed_down
    norm: QTensor | None  # ffn_routed_norm
    up: QTensor  # ffn_routed_up
    shared: Mlp | None

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int) -> "LatentMoe":
        p = f"blk.{i}."
        norm = w.get(p + "ffn_routed_norm.weight")
        shared = Mlp.load(w, i, "_shexp") if p + "ffn_gate_shexp.weight" in w else None
        return cls(w[p + "ffn_gate_inp.weight"], w[p + "exp_probs_b.bias"], w[p + "ffn_routed_down.weight"], norm,
                   w[p + "ffn_routed_up.weight"], shared)


@dataclass(frozen=True)
class Layer:
    """One block's trunk tensors, resolved from their GGUF names at load: a KDA layer has `kda`, an
    MLA layer (a KV head) `mla` and its output gate; a leading dense layer has `dense`, the others
    `moe`."""
    attn_res_score: QTensor
    attn_norm: QTensor
    ffn_res_score: QTensor
    ffn_norm: QTensor
    kda: KdaWeights | None = None
    mla: MlaWeights | None = None
    attn_gate: QTensor | None = None  # the MLA output's sigmoid gate
    dense: Mlp | None = None
    moe: LatentMoe | None = None

    @classmethod
    def load(cls, w: dict[str, QTensor], i: int, a: Args) -> "Layer":
        p = f"blk.{i}."
        common = (w[p + "attn_res_score.weight"], w[p + "attn_norm.weight"], w[p + "ffn_res_score.weight"],
                  w[p + "ffn_norm.weight"])
        if int(a.kv_heads[i]) == 0:
            mixer = {"kda": KdaWeights.load(w, i)}
        else:
            mixer = {"mla": MlaWeights.load(w, i), "attn_gate": w[p + "attn_gate.weight"]}
        ffn = {"dense": Mlp.load(w, i)} if i < a.n_dense else {"moe": LatentMoe.load(w, i)}
        return cls(*common, **mixer, **ffn)


class Model:
    static_decode = True  # a one-token step has static shapes; the KDA states are updated in place
    static_prompt = False  # a prompt advances its states token by token: its shapes stay as they are

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        if a.kda_lower_bound == float("-inf"):
            raise ValueError("kimi-k3: a KDA gate without kda.gate_lower_bound (Kimi-Linear's form) is not supported")
        self.w = w = place.weights(files.trunk)  # by GGUF name, for tools; forward reads the objects below
        self.token_embd, self.output = w["token_embd.weight"], w["output.weight"]
        self.output_res_score, self.output_norm = w["output_res_score.weight"], w["output_norm.weight"]
        self.layers = [Layer.load(w, i, a) for i in range(a.n_layer)]
        self.situ = Activation(ActKind.SITU, beta=a.situ_beta, linear_beta=a.situ_linear_beta)
        self.moe = ExpertFFN(place.ops, files.experts, expert_count(files), self.situ)
        self.moe.router = self.route
        self.place, self.device, self.ops = place, place.first, place.ops

    # ---- the residual stream -------------------------------------------------------------------
    def _mix(self, cur: torch.Tensor, bank: list[torch.Tensor], score: torch.Tensor) -> torch.Tensor:
        """Softmax over the banked checkpoints and the current residual, scored on their
        normalized values, summed on their raw ones."""
        ops = self.ops
        if not bank:
            return cur
        sources = torch.stack([*bank, cur], dim=1)  # [T, n+1, D]
        scores = (ops.rms_norm(sources, None, self.args.eps) * score).sum(-1)
        return (torch.softmax(scores, dim=-1)[..., None] * sources).sum(dim=1)

    # ---- blocks ----------------------------------------------------------------------------------
    def _mla(self, layer: Layer, i: int, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        ops = self.ops
        a, m, t = self.args, layer.mla, len(h)
        q = mla_query(ops, m, h, a.n_head, a.key_mla, a.eps)
        if ops.kernels:
            o = absorbed_attention(ops, m, h, q, i, cache, a.kv_lora, a.key_mla - a.rope_dim, a.eps,
                                   a.key_mla ** -0.5).reshape(t, -1)
        else:
            k_nope, k_pe, value = mla_keys_values(ops, m, h, a.kv_lora, a.eps)
            k_pe = k_pe.expand(t, a.n_head, a.rope_dim)  # shared by the heads, never rotated
            key, value = cache.append(i, torch.cat([k_nope, k_pe], dim=-1), value)
            o = ops.attention(q, key, value, cache.positions(t, q.device), a.key_mla ** -0.5).reshape(t, -1)
        o = o * torch.sigmoid(ops.linear(h, layer.attn_gate))  # the output gate reads the normed input
        return ops.linear(o, m.output)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        a, moe = self.args, self.layers[i].moe
        logits = ops.linear(h.to(torch.float32), moe.router)  # the full-width input
        return sigmoid_group_topk(logits, ops.dequant(moe.router_bias), a.n_expert_used, 1, 1, a.weights_norm,
                                  a.weights_scale)

    def _mlp(self, mlp: Mlp, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(self.situ(ops.linear(h, mlp.gate), ops.linear(h, mlp.up)), mlp.down)

    def _ffn(self, layer: Layer, i: int, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if layer.dense is not None:
            return self._mlp(layer.dense, h)
        moe = layer.moe
        ids, weights = self.route(i, h)
        latent = ops.linear(h, moe.down)
        routed = self.moe(i, latent, ids, weights, router_in=h)
        if moe.norm is not None:
            routed = ops.rms_norm(routed, ops.dequant(moe.norm), self.args.eps)
        out = ops.linear(routed, moe.up)
        if moe.shared is not None:
            out = out + self._mlp(moe.shared, h)
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens [T] -> logits [T, n_vocab]; continues the KV caches and the KDA states."""
        ops = self.ops
        a = self.args
        x = ops.rows(self.token_embd, tokens)
        bank: list[torch.Tensor] = []  # checkpoints of this pass, per token (across depth, not time)
        for i, layer in enumerate(self.layers):
            x, bank = self.place.hop(i, x, bank)
            h = ops.rms_norm(self._mix(x, bank, ops.dequant(layer.attn_res_score)), ops.dequant(layer.attn_norm), a.eps)
            banked = i % a.res_block == 0
            if banked:
                bank.append(x)  # the raw layer input
            if layer.kda is not None:
                out, state = kda(ops, layer.kda, h, cache.state.get(i), a.n_head, a.kda_head_dim, a.kda_lower_bound, a.eps)
                if i in cache.state:
                    cache.state[i].assign(state)  # in place: a captured step keeps its buffers
                else:
                    cache.state[i] = state
            else:
                out = self._mla(layer, i, h, cache)
            x = out if banked else x + out
            h = ops.rms_norm(self._mix(x, bank, ops.dequant(layer.ffn_res_score)), ops.dequant(layer.ffn_norm), a.eps)
            x = x + self._ffn(layer, i, h)
        cache.advance(len(tokens))
        x = self._mix(x, bank, ops.dequant(self.output_res_score))
        return ops.output_logits(ops.rms_norm(x, ops.dequant(self.output_norm), a.eps), self.output, last)
