"""Which tensors a GGUF of each architecture holds, and their ggml shapes, derived from the model's
own GGUF metadata, exactly as llama.cpp's converter writes them. The tests hold these rules against
the real converter's output in shared/fixtures, so a synthetic model has the layout of a real one.

Shapes are ggml `ne` (ne0 = the contiguous row). Kinds decide the type synth writes:
EXPERT -> the expert type; MATRIX -> the trunk type (F16 when rows do not fit its blocks);
ROUTER, F32 -> F32 random; NORM -> F32 around 1; INDEX -> I32 hash-routing table."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable


class Kind(Enum):
    EXPERT = "expert"
    MATRIX = "matrix"
    ROUTER = "router"
    F32 = "f32"
    NORM = "norm"
    INDEX = "index"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: Kind


class Meta:
    """Reads `<arch>.<key>` values; a missing key names every key the architecture needs."""

    def __init__(self, arch: str, values: dict[str, Any], n_vocab: int) -> None:
        self.arch = arch
        self.values = values
        self.n_vocab = n_vocab

    def __call__(self, key: str, default: Any = None) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.values:
            return self.values[full]
        if default is None:
            raise KeyError(f"{self.arch} needs metadata key {full}")
        return default


def _global(m: Meta, extra: list[TensorSpec] = ()) -> list[TensorSpec]:
    h = m("embedding_length")
    return [TensorSpec("token_embd.weight", (h, m.n_vocab), Kind.MATRIX), *extra,
            TensorSpec("output_norm.weight", (h,), Kind.NORM),
            TensorSpec("output.weight", (h, m.n_vocab), Kind.MATRIX)]


def _routed(i: int, h_in: int, h_out: int, ff: int, n_expert: int) -> list[TensorSpec]:
    b = f"blk.{i}."
    return [TensorSpec(b + "ffn_gate_exps.weight", (h_in, ff, n_expert), Kind.EXPERT),
            TensorSpec(b + "ffn_up_exps.weight", (h_in, ff, n_expert), Kind.EXPERT),
            TensorSpec(b + "ffn_down_exps.weight", (ff, h_out, n_expert), Kind.EXPERT)]


def _ffn(b: str, stem: str, h: int, ff: int) -> list[TensorSpec]:
    return [TensorSpec(f"{b}ffn_gate{stem}.weight", (h, ff), Kind.MATRIX),
            TensorSpec(f"{b}ffn_up{stem}.weight", (h, ff), Kind.MATRIX),
            TensorSpec(f"{b}ffn_down{stem}.weight", (ff, h), Kind.MATRIX)]


def _gqa(b: str, h: int, n_head: int, n_kv: int, k_dim: int, v_dim: int) -> list[TensorSpec]:
    return [TensorSpec(b + "attn_q.weight", (h, n_head * k_dim), Kind.MATRIX),
            TensorSpec(b + "attn_k.weight", (h, n_kv * k_dim), Kind.MATRIX),
            TensorSpec(b + "attn_v.weight", (h, n_kv * v_dim), Kind.MATRIX),
            TensorSpec(b + "attn_output.weight", (n_head * v_dim, h), Kind.MATRIX)]


def qwen3moe(m: Meta) -> list[TensorSpec]:
    h, e = m("embedding_length"), m("expert_count")
    k_dim = m("attention.key_length")
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                *_gqa(b, h, m("attention.head_count"), m("attention.head_count_kv"), k_dim,
                      m("attention.value_length")),
                TensorSpec(b + "attn_q_norm.weight", (k_dim,), Kind.NORM),
                TensorSpec(b + "attn_k_norm.weight", (k_dim,), Kind.NORM),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                *_routed(i, h, h, m("expert_feed_forward_length"), e)]
    return _global(m) + out


def qwen2moe(m: Meta) -> list[TensorSpec]:
    """Qwen1.5-MoE / Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert beside the routed ones."""
    h, e, n_head, n_kv = m("embedding_length"), m("expert_count"), m("attention.head_count"), m("attention.head_count_kv")
    head_dim = h // n_head
    ff_shared = m("expert_shared_feed_forward_length")
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                *_gqa(b, h, n_head, n_kv, head_dim, head_dim),
                TensorSpec(b + "attn_q.bias", (n_head * head_dim,), Kind.F32),
                TensorSpec(b + "attn_k.bias", (n_kv * head_dim,), Kind.F32),
                TensorSpec(b + "attn_v.bias", (n_kv * head_dim,), Kind.F32),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                *_routed(i, h, h, m("expert_feed_forward_length"), e),
                TensorSpec(b + "ffn_gate_inp_shexp.weight", (h,), Kind.F32),
                *_ffn(b, "_shexp", h, ff_shared)]
    return _global(m) + out


def llama(m: Meta) -> list[TensorSpec]:
    """Mixtral-style MoE under the `llama` architecture: experts are feed_forward_length wide."""
    h, e, n_head = m("embedding_length"), m("expert_count"), m("attention.head_count")
    head_dim = m("rope.dimension_count", h // n_head)
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                *_gqa(b, h, n_head, m("attention.head_count_kv"), head_dim, head_dim),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                *_routed(i, h, h, m("feed_forward_length"), e)]
    return _global(m) + out


def gpt_oss(m: Meta) -> list[TensorSpec]:
    h, e, ff = m("embedding_length"), m("expert_count"), m("expert_feed_forward_length")
    n_head, n_kv, hd = m("attention.head_count"), m("attention.head_count_kv"), m("attention.key_length")
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "post_attention_norm.weight", (h,), Kind.NORM),
                *_gqa(b, h, n_head, n_kv, hd, hd),
                TensorSpec(b + "attn_q.bias", (n_head * hd,), Kind.F32),
                TensorSpec(b + "attn_k.bias", (n_kv * hd,), Kind.F32),
                TensorSpec(b + "attn_v.bias", (n_kv * hd,), Kind.F32),
                TensorSpec(b + "attn_output.bias", (h,), Kind.F32),
                TensorSpec(b + "attn_sinks.weight", (n_head,), Kind.F32),
                TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                TensorSpec(b + "ffn_gate_inp.bias", (e,), Kind.F32),
                *_routed(i, h, h, ff, e),
                TensorSpec(b + "ffn_gate_exps.bias", (ff, e), Kind.F32),
                TensorSpec(b + "ffn_up_exps.bias", (ff, e), Kind.F32),
                TensorSpec(b + "ffn_down_exps.bias", (h, e), Kind.F32)]
    return _global(m) + out


def deepseek2(m: Meta) -> list[TensorSpec]:
    """DeepSeek-V2/V3/R1, Kimi-K2: MLA with the converter's split attn_k_b / attn_v_b."""
    h, e, n_head = m("embedding_length"), m("expert_count"), m("attention.head_count")
    rope, kv_lora, q_lora = m("rope.dimension_count"), m("attention.kv_lora_rank"), m("attention.q_lora_rank")
    k_mla, v_mla = m("attention.key_length_mla"), m("attention.value_length_mla")
    nope = k_mla - rope
    n_dense = m("leading_dense_block_count", 0)
    ff_exp, n_shared = m("expert_feed_forward_length"), m("expert_shared_count", 0)
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "attn_q_a.weight", (h, q_lora), Kind.MATRIX),
                TensorSpec(b + "attn_q_a_norm.weight", (q_lora,), Kind.NORM),
                TensorSpec(b + "attn_q_b.weight", (q_lora, n_head * k_mla), Kind.MATRIX),
                TensorSpec(b + "attn_kv_a_mqa.weight", (h, kv_lora + rope), Kind.MATRIX),
                TensorSpec(b + "attn_kv_a_norm.weight", (kv_lora,), Kind.NORM),
                TensorSpec(b + "attn_k_b.weight", (nope, kv_lora, n_head), Kind.MATRIX),
                TensorSpec(b + "attn_v_b.weight", (kv_lora, v_mla, n_head), Kind.MATRIX),
                TensorSpec(b + "attn_output.weight", (n_head * v_mla, h), Kind.MATRIX),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM)]
        if i < n_dense:
            out += _ffn(b, "", h, m("feed_forward_length"))
            continue
        out += [TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                TensorSpec(b + "exp_probs_b.bias", (e,), Kind.F32),
                *_routed(i, h, h, ff_exp, e)]
        if n_shared:
            out += _ffn(b, "_shexp", h, ff_exp * n_shared)
    return _global(m) + out


def deepseek4(m: Meta) -> list[TensorSpec]:
    """DeepSeek-V4: hyper-connections, shared-KV attention with compressor/indexer on CSA (ratio 4)
    and HCA (ratio 128) layers, hash-routed first layers (tid2eid), sqrt-softplus routing."""
    h, e, n_head = m("embedding_length"), m("expert_count"), m("attention.head_count")
    hd, q_lora = m("attention.key_length"), m("attention.q_lora_rank")
    groups, o_lora = m("attention.output_group_count"), m("attention.output_lora_rank")
    hc = m("hyper_connection.count")
    mix = (2 + hc) * hc
    idx_heads, idx_dim = m("attention.indexer.head_count"), m("attention.indexer.key_length")
    ratios = m("attention.compress_ratios")
    n_hash, k = m("hash_layer_count", 0), m("expert_used_count")
    ff_exp, n_shared = m("expert_feed_forward_length"), m("expert_shared_count", 0)
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        ratio = ratios[i]
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM)]
        for site in ("attn", "ffn"):
            out += [TensorSpec(f"{b}hc_{site}_fn.weight", (hc * h, mix), Kind.F32),
                    TensorSpec(f"{b}hc_{site}_base.weight", (mix,), Kind.F32),
                    TensorSpec(f"{b}hc_{site}_scale.weight", (3,), Kind.F32)]
        out += [TensorSpec(b + "attn_q_a.weight", (h, q_lora), Kind.MATRIX),
                TensorSpec(b + "attn_q_a_norm.weight", (q_lora,), Kind.NORM),
                TensorSpec(b + "attn_q_b.weight", (q_lora, n_head * hd), Kind.MATRIX),
                TensorSpec(b + "attn_kv.weight", (h, hd), Kind.MATRIX),
                TensorSpec(b + "attn_kv_a_norm.weight", (hd,), Kind.NORM),
                TensorSpec(b + "attn_sinks.weight", (n_head,), Kind.F32),
                TensorSpec(b + "attn_output_a.weight", (n_head * hd // groups, groups * o_lora), Kind.MATRIX),
                TensorSpec(b + "attn_output_b.weight", (groups * o_lora, h), Kind.MATRIX)]
        if ratio:
            c = 2 if ratio == 4 else 1  # CSA overlaps two window series
            out += [TensorSpec(b + "attn_compressor_kv.weight", (h, c * hd), Kind.MATRIX),
                    TensorSpec(b + "attn_compressor_gate.weight", (h, c * hd), Kind.MATRIX),
                    TensorSpec(b + "attn_compressor_ape.weight", (c * hd, ratio), Kind.F32),
                    TensorSpec(b + "attn_compressor_norm.weight", (hd,), Kind.NORM)]
        if ratio == 4:
            out += [TensorSpec(b + "indexer.attn_q_b.weight", (q_lora, idx_heads * idx_dim), Kind.MATRIX),
                    TensorSpec(b + "indexer.proj.weight", (h, idx_heads), Kind.MATRIX),
                    TensorSpec(b + "indexer_compressor_kv.weight", (h, 2 * idx_dim), Kind.MATRIX),
                    TensorSpec(b + "indexer_compressor_gate.weight", (h, 2 * idx_dim), Kind.MATRIX),
                    TensorSpec(b + "indexer_compressor_ape.weight", (2 * idx_dim, 4), Kind.F32),
                    TensorSpec(b + "indexer_compressor_norm.weight", (idx_dim,), Kind.NORM)]
        out.append(TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER))
        if i < n_hash:
            out.append(TensorSpec(b + "ffn_gate_tid2eid.weight", (k, m.n_vocab), Kind.INDEX))
        else:
            out.append(TensorSpec(b + "exp_probs_b.bias", (e,), Kind.F32))
        out += _ffn(b, "_shexp", h, ff_exp * n_shared)
        out += _routed(i, h, h, ff_exp, e)
    head = [TensorSpec("output_hc_fn.weight", (hc * h, hc), Kind.F32),
            TensorSpec("output_hc_base.weight", (hc,), Kind.F32),
            TensorSpec("output_hc_scale.weight", (1,), Kind.F32)]
    return _global(m, head) + out


def kimi_k3(m: Meta) -> list[TensorSpec]:
    """Kimi-K3: KDA layers (head_count_kv 0) and gated NoPE MLA layers, attention-residual scores,
    dense leading layers, then a latent MoE (experts on `expert_latent_length`) with shared experts."""
    h, e, n_head = m("embedding_length"), m("expert_count"), m("attention.head_count")
    hd, kernel = m("kda.head_dim"), m("ssm.conv_kernel")
    d_inner = n_head * hd
    rope, kv_lora, q_lora = m("rope.dimension_count"), m("attention.kv_lora_rank"), m("attention.q_lora_rank")
    k_mla, v_mla = m("attention.key_length_mla"), m("attention.value_length_mla")
    n_dense, latent = m("leading_dense_block_count", 0), m("expert_latent_length")
    ff_exp, n_shared = m("expert_feed_forward_length"), m("expert_shared_count", 0)
    kv_heads = m("attention.head_count_kv")
    out = []
    for i in range(m("block_count")):
        b = f"blk.{i}."
        out += [TensorSpec(b + "attn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "ffn_norm.weight", (h,), Kind.NORM),
                TensorSpec(b + "attn_res_score.weight", (h,), Kind.F32),
                TensorSpec(b + "ffn_res_score.weight", (h,), Kind.F32)]
        if kv_heads[i] == 0:  # Kimi Delta Attention
            out += [TensorSpec(f"{b}attn_{n}.weight", (h, d_inner), Kind.MATRIX) for n in "qkv"]
            out += [TensorSpec(f"{b}ssm_conv1d_{n}.weight", (kernel, 1, d_inner, 1), Kind.F32) for n in "qkv"]
            out += [TensorSpec(b + "ssm_f_a.weight", (h, hd), Kind.MATRIX),
                    TensorSpec(b + "ssm_f_b.weight", (hd, d_inner), Kind.MATRIX),
                    TensorSpec(b + "ssm_beta.weight", (h, n_head), Kind.MATRIX),
                    TensorSpec(b + "ssm_a", (n_head,), Kind.F32),
                    TensorSpec(b + "ssm_dt.bias", (d_inner,), Kind.F32),
                    TensorSpec(b + "ssm_g.weight", (h, d_inner), Kind.MATRIX),
                    TensorSpec(b + "ssm_norm.weight", (hd,), Kind.NORM),
                    TensorSpec(b + "attn_output.weight", (d_inner, h), Kind.MATRIX)]
        else:  # gated MLA without positional encoding
            out += [TensorSpec(b + "attn_q_a.weight", (h, q_lora), Kind.MATRIX),
                    TensorSpec(b + "attn_q_a_norm.weight", (q_lora,), Kind.NORM),
                    TensorSpec(b + "attn_q_b.weight", (q_lora, n_head * k_mla), Kind.MATRIX),
                    TensorSpec(b + "attn_kv_a_mqa.weight", (h, kv_lora + rope), Kind.MATRIX),
                    TensorSpec(b + "attn_kv_a_norm.weight", (kv_lora,), Kind.NORM),
                    TensorSpec(b + "attn_k_b.weight", (k_mla - rope, kv_lora, n_head), Kind.MATRIX),
                    TensorSpec(b + "attn_v_b.weight", (kv_lora, v_mla, n_head), Kind.MATRIX),
                    TensorSpec(b + "attn_gate.weight", (h, n_head * v_mla), Kind.MATRIX),
                    TensorSpec(b + "attn_output.weight", (n_head * v_mla, h), Kind.MATRIX)]
        if i < n_dense:
            out += _ffn(b, "", h, m("feed_forward_length"))
            continue
        out += [TensorSpec(b + "ffn_gate_inp.weight", (h, e), Kind.ROUTER),
                TensorSpec(b + "exp_probs_b.bias", (e,), Kind.F32),
                TensorSpec(b + "ffn_routed_down.weight", (h, latent), Kind.MATRIX),
                TensorSpec(b + "ffn_routed_norm.weight", (latent,), Kind.NORM),
                TensorSpec(b + "ffn_routed_up.weight", (latent, h), Kind.MATRIX),
                *_routed(i, latent, latent, ff_exp, e)]
        if n_shared:
            out += _ffn(b, "_shexp", h, ff_exp * n_shared)
    return _global(m, [TensorSpec("output_res_score.weight", (h,), Kind.F32)]) + out


# The one place that says which architectures synth can write.
ARCHS: dict[str, Callable[[Meta], list[TensorSpec]]] = {
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "llama": llama,
    "gpt-oss": gpt_oss,
    "deepseek2": deepseek2,
    "deepseek4": deepseek4,
    "kimi-k3": kimi_k3,
}
