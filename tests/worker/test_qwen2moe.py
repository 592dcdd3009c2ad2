"""qwen2moe has no llama.cpp fixture, so its reference is transformers' own Qwen2MoeForCausalLM
loaded with the very values of a synthetic GGUF (F32, so nothing is lost; and Q8_0 experts,
dequantized for transformers): logits within float32 summation noise, identical greedy
continuation. The synthetic tensor layout is held to llama.cpp's naming by the synth tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler

from .synthetic import gguf_values, load_exactly, stack, synth_gguf

META = {
    "block_count": 2, "context_length": 512, "embedding_length": 256, "feed_forward_length": 512,
    "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 1000000.0,
    "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 8, "expert_used_count": 2,
    "expert_feed_forward_length": 128, "expert_shared_feed_forward_length": 384,
}


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_gguf(tmp_path_factory.mktemp("qwen2moe") / "m.gguf", "qwen2moe", META, 512, request.param)


def hf_model(path: Path):
    w, experts = gguf_values(path, range(2), 8)
    config = transformers.Qwen2MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=128, shared_expert_intermediate_size=384, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    hf = transformers.Qwen2MoeForCausalLM(config).to(torch.float32).eval()
    state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
             "lm_head.weight": w["output.weight"]}
    for i in range(2):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        for gguf, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            state[q + f"self_attn.{theirs}.weight"] = w[p + gguf + ".weight"]
            state[q + f"self_attn.{theirs}.bias"] = w[p + gguf + ".bias"]
        state[q + "self_attn.o_proj.weight"] = w[p + "attn_output.weight"]
        state[q + "input_layernorm.weight"] = w[p + "attn_norm.weight"]
        state[q + "post_attention_layernorm.weight"] = w[p + "ffn_norm.weight"]
        state[q + "mlp.gate.weight"] = w[p + "ffn_gate_inp.weight"]
        state[q + "mlp.experts.gate_up_proj"] = torch.cat([stack(experts[i], "gate"), stack(experts[i], "up")], dim=1)
        state[q + "mlp.experts.down_proj"] = stack(experts[i], "down")
        for part in ("gate", "up", "down"):
            state[q + f"mlp.shared_expert.{part}_proj.weight"] = w[p + f"ffn_{part}_shexp.weight"]
        state[q + "mlp.shared_expert_gate.weight"] = w[p + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    load_exactly(hf, state)
    return hf


def test_matches_transformers_on_the_same_values(model: Path) -> None:
    hf = hf_model(model)
    engine = Engine.load(model)
    tokens = np.random.default_rng(0).integers(0, 512, 40).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
        expected = hf.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 40:]
    got = engine.forward(tokens, engine.new_sequence())
    assert (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    assert engine.generate(tokens, 8, Sampler())[0] == expected.tolist()
