"""Model shapes synth can imitate, written as the GGUF metadata llama.cpp's converter writes for the
real model (keys without the `<arch>.` prefix), plus the vocabulary size and default types. The
tensor list follows from the metadata (archs.py). Hyper-parameters are from each model's published
config.json; where a value does not change any tensor shape and is unknown it is marked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    arch: str
    description: str
    n_vocab: int
    family: str  # tokenizer family: special tokens and chat template (vocab.py)
    pre: str  # tokenizer.ggml.pre, the pre-tokenizer llama.cpp applies
    expert_type: str
    trunk_type: str
    meta: dict[str, Any] = field(default_factory=dict)
    # Per-tensor types where a llama.cpp quant mix departs from expert_type/trunk_type, keyed by the
    # tensor name without `blk.N.` (`ffn_down_exps.weight`: a per-role expert type). --type and
    # --trunk-type replace these for their kind of tensor.
    types: dict[str, str] = field(default_factory=dict)
    fallback_type: str = "F16"  # for matrices whose rows do not fill whole blocks of their type

    def expert_types(self) -> str:
        """`Q2_K` or, with per-role types, `Q2_K/Q3_K` (distinct types of the expert tensors)."""
        roles = [t for name, t in self.types.items() if name.endswith("_exps.weight")]
        return "/".join(dict.fromkeys([self.expert_type, *roles]))


_QWEN3_30B = {
    "block_count": 48, "context_length": 40960, "embedding_length": 2048, "feed_forward_length": 6144,
    "attention.head_count": 32, "attention.head_count_kv": 4, "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 128, "expert_used_count": 8,
    "attention.key_length": 128, "attention.value_length": 128, "expert_feed_forward_length": 768,
}

_GPT_OSS_20B = {
    "block_count": 24, "context_length": 131072, "embedding_length": 2880, "feed_forward_length": 2880,
    "attention.head_count": 64, "attention.head_count_kv": 8, "rope.scaling.type": "yarn",
    "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
    "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0, "rope.freq_base": 150000.0,
    "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": 32, "expert_used_count": 4,
    "attention.key_length": 64, "attention.value_length": 64, "attention.sliding_window": 128,
    "expert_feed_forward_length": 2880,
}

_DEEPSEEK_V3 = {
    "block_count": 61, "context_length": 163840, "embedding_length": 7168, "feed_forward_length": 18432,
    "attention.head_count": 128, "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 256, "expert_used_count": 8,
    "expert_group_count": 8, "expert_group_used_count": 4, "expert_gating_func": 2,
    "attention.key_length": 576, "attention.value_length": 512, "leading_dense_block_count": 3,
    "vocab_size": 129280, "attention.q_lora_rank": 1536, "attention.kv_lora_rank": 512,
    "attention.key_length_mla": 192, "attention.value_length_mla": 128, "expert_feed_forward_length": 2048,
    "expert_shared_count": 1, "expert_weights_scale": 2.5, "expert_weights_norm": True,
    "rope.dimension_count": 64, "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
    "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_log_multiplier": 0.1,
}

# DeepSeek-V4-Flash per transformers' DeepseekV4Config defaults (shared/fixtures/flagship/
# ARCHITECTURE.md). Its per-layer compress ratios are not documented there; this pattern (two
# sliding-window layers, then CSA and HCA alternating) changes only trunk tensors, never the experts.
_DSV4_LAYERS = 43
_DEEPSEEK_V4_FLASH = {
    "block_count": _DSV4_LAYERS, "context_length": 1048576, "embedding_length": 4096,
    "attention.head_count": 64, "attention.head_count_kv": 1, "rope.scaling.type": "yarn",
    "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 65536,
    "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0, "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 256, "expert_used_count": 6,
    "expert_gating_func": 4, "attention.key_length": 512, "attention.value_length": 512,
    "rope.dimension_count": 64, "attention.q_lora_rank": 1024, "attention.sliding_window": 128,
    "expert_feed_forward_length": 2048, "expert_shared_count": 1, "expert_weights_scale": 1.5,
    "expert_weights_norm": True, "swiglu_clamp_exp": [10.0] * _DSV4_LAYERS,
    "swiglu_clamp_shexp": [10.0] * _DSV4_LAYERS, "attention.indexer.head_count": 64,
    "attention.indexer.key_length": 128, "attention.indexer.top_k": 512,
    "attention.output_group_count": 8, "attention.output_lora_rank": 1024,
    "attention.compress_ratios": [0, 0] + [4, 128] * 20 + [4],
    "attention.compress_rope_freq_base": 160000.0, "hyper_connection.count": 4,
    "hyper_connection.sinkhorn_iterations": 20, "hyper_connection.epsilon": 1e-6, "hash_layer_count": 3,
    "embedding_length_out": 4 * 4096,
}

# Kimi-K3 (2.8T-A50B) per shared/fixtures/flagship/kimi-k3/real-shapes.json (the real config.json's
# text_config), written as llama.cpp's kimi-k3 converter writes it (keys of the fixture k3-tiny GGUFs).
# Not published, chosen here; none changes an expert block, and only the first the trunk's layout:
# - which layers are MLA: the family's KDA:MLA 3:1, MLA at every 4th layer (1-based full_attn_layers
#   4, 8, ..., 92), so 70 KDA and 23 MLA layers; a --layers cut keeps one of each (LAYER_KINDS).
# - attn_res.block_size 8 (any value gives the same sizes), expert_weights_scale 2.5 and rms eps 1e-5
#   (the fixture's values), context_length 262144; rope.freq_base is unused (MLA without rope).
_K3_LAYERS = 93
_KIMI_K3 = {
    "block_count": _K3_LAYERS, "context_length": 262144, "embedding_length": 7168, "feed_forward_length": 33792,
    "attention.head_count": 96, "attention.head_count_kv": [1 if (i + 1) % 4 == 0 else 0 for i in range(_K3_LAYERS)],
    "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": 896,
    "expert_used_count": 16, "expert_gating_func": 2, "vocab_size": 163840, "ssm.conv_kernel": 4,
    "kda.head_dim": 128, "kda.gate_lower_bound": -5.0, "attention.q_lora_rank": 1536,
    "attention.kv_lora_rank": 512, "rope.dimension_count": 64, "attention.key_length": 512 + 64,
    "attention.value_length": 512, "attention.key_length_mla": 128 + 64, "attention.value_length_mla": 128,
    "expert_feed_forward_length": 3072, "expert_shared_count": 2, "leading_dense_block_count": 1,
    "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_latent_length": 3584,
    "activation.situ_beta": 4.0, "activation.situ_linear_beta": 25.0, "attn_res.block_size": 8,
}

# What `llama-quantize ... Q2_K` writes for Kimi-K3 (llama.cpp's llama_tensor_get_type, as the fixture
# k3-tiny.Q2_K.gguf shows it): Q2_K by default and for gate/up experts; every ffn_down (experts, shared,
# dense) Q3_K; attn_output Q5_K (MoE with 8+ experts); attn_v Q3_K; output Q6_K; F32 routers and norms;
# a matrix whose rows do not fill 256-value blocks (attn_k_b's 128, ssm_f_b's 128) Q4_0. The fixture's
# Q8_0 attn_k/attn_v come from llama.cpp's rule for exactly 8 experts, which the real 896 do not meet.
_Q2_K_MIX = {"ffn_down_exps.weight": "Q3_K", "ffn_down.weight": "Q3_K", "ffn_down_shexp.weight": "Q3_K",
             "attn_output.weight": "Q5_K", "attn_v.weight": "Q3_K", "output.weight": "Q6_K"}

_MIXTRAL_8X7B = {
    "block_count": 32, "context_length": 32768, "embedding_length": 4096, "feed_forward_length": 14336,
    "attention.head_count": 32, "attention.head_count_kv": 8, "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": 8, "expert_used_count": 2,
    "vocab_size": 32000, "rope.dimension_count": 128,
}

# Small enough for tests and `make demo` on two CPU cores, K-quant friendly (rows of 256).
_TINY = {
    "block_count": 4, "context_length": 4096, "embedding_length": 256, "feed_forward_length": 512,
    "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 16, "expert_used_count": 4,
    "attention.key_length": 64, "attention.value_length": 64, "expert_feed_forward_length": 256,
}

# A few hundred MB: big enough that a build takes seconds (resume tests, quick benchmarks).
_SMALL = {
    "block_count": 8, "context_length": 4096, "embedding_length": 1024, "feed_forward_length": 2048,
    "attention.head_count": 8, "attention.head_count_kv": 4, "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 32, "expert_used_count": 4,
    "attention.key_length": 128, "attention.value_length": 128, "expert_feed_forward_length": 512,
}

PRESETS: dict[str, Preset] = {
    "tiny": Preset("qwen3moe", "4-layer Qwen3-MoE, 16 experts top-4 (tests, demo)", 2048, "chatml", "qwen2",
                   "Q4_K", "Q8_0", _TINY),
    "small": Preset("qwen3moe", "8-layer Qwen3-MoE, 32 experts top-4 (resume tests, quick benchmarks)", 8192,
                    "chatml", "qwen2", "Q4_K", "Q8_0", _SMALL),
    "qwen3-30b-a3b": Preset("qwen3moe", "Qwen3-30B-A3B: 48 layers, 128 experts top-8", 151936, "chatml",
                            "qwen2", "Q4_K", "Q8_0", _QWEN3_30B),
    "gpt-oss-20b": Preset("gpt-oss", "gpt-oss-20b: 24 layers, 32 experts top-4, MXFP4 experts", 201088,
                          "harmony", "gpt-4o", "MXFP4", "Q8_0", _GPT_OSS_20B),
    "deepseek-v3": Preset("deepseek2", "DeepSeek-V3/R1: 61 layers (3 dense), 256 experts top-8 + 1 shared",
                          129280, "deepseek", "deepseek-v3", "Q4_K", "Q8_0", _DEEPSEEK_V3),
    "deepseek-v4-flash": Preset("deepseek4", "DeepSeek-V4-Flash: 43 layers, 256 experts top-6 + 1 shared, MXFP4",
                                129280, "deepseek", "deepseek-v3", "MXFP4", "Q8_0", _DEEPSEEK_V4_FLASH),
    "kimi-k3": Preset("kimi-k3", "Kimi-K3: 93 layers (1 dense, KDA:MLA 3:1), 896 latent experts top-16 + 2 shared, "
                      "Q2_K mix", 163840, "kimi", "kimi-k2", "Q2_K", "Q2_K", _KIMI_K3, _Q2_K_MIX, "Q4_0"),
    "mixtral-8x7b": Preset("llama", "Mixtral-8x7B: 32 layers, 8 experts top-2", 32000, "chatml", "default",
                           "Q4_K", "Q8_0", _MIXTRAL_8X7B),
}

