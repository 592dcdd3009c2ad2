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
from ..nn.kda import kda
from ..nn.layers import KVCache, attention, output_logits, rms_norm
from ..nn.mla import MlaWeights, absorbed_attention, mla_keys_values, mla_query
from ..nn.moe import ExpertFFN
from ..nn.placement import Placement
from ..nn.routing import sigmoid_group_topk
from ..weights.model_files import ModelFiles, expert_count
from ..weights.qtensor import linear, use_kernels
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


class Model:
    static_decode = True  # a one-token step has static shapes; the KDA states are updated in place
    static_prompt = False  # a prompt advances its states token by token: its shapes stay as they are

    def __init__(self, files: ModelFiles, place: Placement) -> None:
        self.args = a = read_args(Args, files.arch, files.metadata, KEYS)
        if a.kda_lower_bound == float("-inf"):
            raise ValueError("kimi-k3: a KDA gate without kda.gate_lower_bound (Kimi-Linear's form) is not supported")
        self.w = w = place.weights(files.trunk)
        self.mla = {i: MlaWeights.load(w, i) for i in range(a.n_layer) if int(a.kv_heads[i]) != 0}
        self.situ = Activation(ActKind.SITU, beta=a.situ_beta, linear_beta=a.situ_linear_beta)
        self.moe = ExpertFFN(files.experts, expert_count(files), self.situ)
        self.moe.router = self.route
        self.place, self.device = place, place.first

    # ---- the residual stream -------------------------------------------------------------------
    def _mix(self, cur: torch.Tensor, bank: list[torch.Tensor], score: torch.Tensor) -> torch.Tensor:
        """Softmax over the banked checkpoints and the current residual, scored on their
        normalized values, summed on their raw ones."""
        if not bank:
            return cur
        sources = torch.stack([*bank, cur], dim=1)  # [T, n+1, D]
        scores = (rms_norm(sources, None, self.args.eps) * score).sum(-1)
        return (torch.softmax(scores, dim=-1)[..., None] * sources).sum(dim=1)

    # ---- blocks ----------------------------------------------------------------------------------
    def _mla(self, i: int, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        a, w, p, m, t = self.args, self.w, f"blk.{i}.", self.mla[i], len(h)
        q = mla_query(m, h, a.n_head, a.key_mla, a.eps)
        if use_kernels(h.device):
            o = absorbed_attention(m, h, q, i, cache, a.kv_lora, a.key_mla - a.rope_dim, a.eps,
                                   a.key_mla ** -0.5).reshape(t, -1)
        else:
            k_nope, k_pe, value = mla_keys_values(m, h, a.kv_lora, a.eps)
            k_pe = k_pe.expand(t, a.n_head, a.rope_dim)  # shared by the heads, never rotated
            key, value = cache.append(i, torch.cat([k_nope, k_pe], dim=-1), value)
            o = attention(q, key, value, cache.positions(t, q.device), a.key_mla ** -0.5).reshape(t, -1)
        o = o * torch.sigmoid(linear(h, w[p + "attn_gate.weight"]))  # the output gate reads the normed input
        return linear(o, m.output)

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, w, p = self.args, self.w, f"blk.{i}."
        logits = linear(h.to(torch.float32), w[p + "ffn_gate_inp.weight"])  # the full-width input
        return sigmoid_group_topk(logits, w[p + "exp_probs_b.bias"].dequant(), a.n_expert_used, 1, 1, a.weights_norm,
                                  a.weights_scale)

    def _ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        a, w, p = self.args, self.w, f"blk.{i}."
        if i < a.n_dense:
            return linear(self.situ(linear(h, w[p + "ffn_gate.weight"]), linear(h, w[p + "ffn_up.weight"])),
                          w[p + "ffn_down.weight"])
        ids, weights = self.route(i, h)
        latent = linear(h, w[p + "ffn_routed_down.weight"])
        routed = self.moe(i, latent, ids, weights, router_in=h)
        if p + "ffn_routed_norm.weight" in w:
            routed = rms_norm(routed, w[p + "ffn_routed_norm.weight"].dequant(), a.eps)
        out = linear(routed, w[p + "ffn_routed_up.weight"])
        if p + "ffn_gate_shexp.weight" in w:
            out = out + linear(self.situ(linear(h, w[p + "ffn_gate_shexp.weight"]), linear(h, w[p + "ffn_up_shexp.weight"])),
                               w[p + "ffn_down_shexp.weight"])
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: bool = False) -> torch.Tensor:
        """tokens [T] -> logits [T, n_vocab]; continues the KV caches and the KDA states."""
        a, w = self.args, self.w
        x = w["token_embd.weight"].rows(tokens)
        bank: list[torch.Tensor] = []  # checkpoints of this pass, per token (across depth, not time)
        for i in range(a.n_layer):
            p = f"blk.{i}."
            x, bank = self.place.hop(i, x, bank)
            h = rms_norm(self._mix(x, bank, w[p + "attn_res_score.weight"].dequant()),
                         w[p + "attn_norm.weight"].dequant(), a.eps)
            banked = i % a.res_block == 0
            if banked:
                bank.append(x)  # the raw layer input
            if int(a.kv_heads[i]) == 0:
                out, state = kda(w, p, h, cache.state.get(i), a.n_head, a.kda_head_dim, a.kda_lower_bound, a.eps)
                if i in cache.state:
                    cache.state[i].assign(state)  # in place: a captured step keeps its buffers
                else:
                    cache.state[i] = state
            else:
                out = self._mla(i, h, cache)
            x = out if banked else x + out
            h = rms_norm(self._mix(x, bank, w[p + "ffn_res_score.weight"].dequant()),
                         w[p + "ffn_norm.weight"].dequant(), a.eps)
            x = x + self._ffn(i, h)
        cache.length += len(tokens)
        x = self._mix(x, bank, w["output_res_score.weight"].dequant())
        return output_logits(rms_norm(x, w["output_norm.weight"].dequant(), a.eps), w["output.weight"], last)
