"""Features the llama.cpp fixtures leave untested, checked against transformers on synthetic GGUFs
loaded into its models value for value: DeepSeek's YaRN (interpolated frequencies, mscale^2 on the
softmax scale, MLA from the converter's split k_b/v_b), and gpt-oss's sliding window on sequences
longer than the window (the fixture's prompt is shorter than its window)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler

from .synthetic import gguf_values, load_exactly, stack, synth_gguf

DEEPSEEK = {
    "block_count": 3, "context_length": 4096, "embedding_length": 256, "feed_forward_length": 384,
    "attention.head_count": 4, "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 8, "expert_used_count": 2,
    "expert_group_count": 4, "expert_group_used_count": 2, "expert_gating_func": 2,
    "attention.key_length": 96, "attention.value_length": 64, "leading_dense_block_count": 1,
    "attention.q_lora_rank": 128, "attention.kv_lora_rank": 64, "attention.key_length_mla": 96,
    "attention.value_length_mla": 64, "expert_feed_forward_length": 128, "expert_shared_count": 1,
    "expert_weights_scale": 2.5, "expert_weights_norm": True, "rope.dimension_count": 32,
    "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 32,
    "rope.scaling.yarn_log_multiplier": 0.1,
}

GPT_OSS = {
    "block_count": 2, "context_length": 4096, "embedding_length": 256, "feed_forward_length": 256,
    "attention.head_count": 4, "attention.head_count_kv": 2, "rope.scaling.type": "yarn",
    "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 64, "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0, "rope.freq_base": 150000.0, "attention.layer_norm_rms_epsilon": 1e-5,
    "expert_count": 8, "expert_used_count": 2, "attention.key_length": 64, "attention.value_length": 64,
    "attention.sliding_window": 12, "expert_feed_forward_length": 128,
}


def compare(path: Path, hf: torch.nn.Module, n_tokens: int, vocab: int) -> None:
    engine = Engine.load(path)
    tokens = np.random.default_rng(1).integers(0, vocab, n_tokens).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
        expected = hf.generate(torch.tensor([tokens]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, n_tokens:]
    got = engine.forward(tokens, engine.new_sequence())
    assert (got - want).abs().max() <= 1e-4, f"max |diff| {(got - want).abs().max():.3g}"
    assert engine.generate(tokens, 6, Sampler())[0] == expected.tolist()


def test_deepseek2_yarn_and_mla(tmp_path: Path) -> None:
    path = synth_gguf(tmp_path / "ds.gguf", "deepseek2", DEEPSEEK, 512, family="deepseek", pre="deepseek-v3")
    w, experts = gguf_values(path, range(1, 3), 8)
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, v_head_dim=64,
        qk_nope_head_dim=64, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=1280, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False)
    hf = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
             "lm_head.weight": w["output.weight"]}
    for i in range(3):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        a = q + "self_attn."
        state[a + "q_a_proj.weight"] = w[p + "attn_q_a.weight"]
        state[a + "q_a_layernorm.weight"] = w[p + "attn_q_a_norm.weight"]
        state[a + "q_b_proj.weight"] = w[p + "attn_q_b.weight"]
        state[a + "kv_a_proj_with_mqa.weight"] = w[p + "attn_kv_a_mqa.weight"]
        state[a + "kv_a_layernorm.weight"] = w[p + "attn_kv_a_norm.weight"]
        k_b, v_b = w[p + "attn_k_b.weight"], w[p + "attn_v_b.weight"]  # [H, kv_lora, nope], [H, v, kv_lora]
        state[a + "kv_b_proj.weight"] = torch.cat([torch.cat([k_b[h].T, v_b[h]]) for h in range(4)])
        state[a + "o_proj.weight"] = w[p + "attn_output.weight"]
        state[q + "input_layernorm.weight"] = w[p + "attn_norm.weight"]
        state[q + "post_attention_layernorm.weight"] = w[p + "ffn_norm.weight"]
        if i == 0:
            for part in ("gate", "up", "down"):
                state[q + f"mlp.{part}_proj.weight"] = w[p + f"ffn_{part}.weight"]
            continue
        state[q + "mlp.gate.weight"] = w[p + "ffn_gate_inp.weight"]
        state[q + "mlp.gate.e_score_correction_bias"] = w[p + "exp_probs_b.bias"]
        state[q + "mlp.experts.gate_up_proj"] = torch.cat([stack(experts[i], "gate"), stack(experts[i], "up")], dim=1)
        state[q + "mlp.experts.down_proj"] = stack(experts[i], "down")
        for part in ("gate", "up", "down"):
            state[q + f"mlp.shared_experts.{part}_proj.weight"] = w[p + f"ffn_{part}_shexp.weight"]
    load_exactly(hf, state)
    compare(path, hf, 60, 512)  # positions well past the original context of 32: YaRN matters


def test_gpt_oss_past_the_sliding_window(tmp_path: Path) -> None:
    path = synth_gguf(tmp_path / "oss.gguf", "gpt-oss", GPT_OSS, 512, family="harmony", pre="gpt-4o")
    w, experts = gguf_values(path, range(2), 8)
    config = transformers.GptOssConfig(
        vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)
    hf = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    hf.config._attn_implementation = "eager"
    state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
             "lm_head.weight": w["output.weight"]}
    for i in range(2):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for gguf, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            state[q + f"self_attn.{theirs}.weight"] = w[p + gguf + ".weight"]
            state[q + f"self_attn.{theirs}.bias"] = w[p + gguf + ".bias"]
        state[q + "self_attn.sinks"] = w[p + "attn_sinks.weight"]
        state[q + "input_layernorm.weight"] = w[p + "attn_norm.weight"]
        state[q + "post_attention_layernorm.weight"] = w[p + "post_attention_norm.weight"]
        state[q + "mlp.router.weight"] = w[p + "ffn_gate_inp.weight"]
        state[q + "mlp.router.bias"] = w[p + "ffn_gate_inp.bias"]
        gate, up = stack(experts[i], "gate"), stack(experts[i], "up")  # [E, F, D]
        interleaved = torch.stack([gate, up], dim=2).reshape(8, 256, 256)  # rows gate0, up0, gate1, ...
        state[q + "mlp.experts.gate_up_proj"] = interleaved.transpose(1, 2)  # [E, D, 2F]: x @ W
        state[q + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [stack(experts[i], "gate.bias"), stack(experts[i], "up.bias")], dim=2).reshape(8, 256)
        state[q + "mlp.experts.down_proj"] = stack(experts[i], "down").transpose(1, 2)  # [E, F, D]
        state[q + "mlp.experts.down_proj_bias"] = stack(experts[i], "down.bias")
    load_exactly(hf, state)
    compare(path, hf, 40, 512)  # 40 tokens, window 12
