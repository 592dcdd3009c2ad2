"""The fast path wired into whole models: every linear and every MoE layer through the Triton
kernels (here under Triton's interpreter, on CUDA in tests/gpu) gives the logits of the torch path
on real llama.cpp files, through a prefill and decode steps (static shapes), within float32 rounding
(the kernels sum in another order); the reference logits' std is ~1."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine import Engine
from expertpack.worker.weights import kernels_on_cpu

from ..conftest import FIXTURES

MODELS = [  # one of each expert activation and weight family the fixtures hold
    "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",  # SwiGLU, Q4_K/Q6_K, GQA with q/k norms
    pytest.param("gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf", marks=pytest.mark.slow),  # clamped SwiGLU, biases, MXFP4
    pytest.param("gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", marks=pytest.mark.slow),  # MLA, shared experts, Q2_K/Q3_K
    pytest.param("flagship/deepseek4/dsv4-tiny.Q2_K.gguf", marks=pytest.mark.slow),  # clamped SwiGLU per layer, mHC
    pytest.param("flagship/kimi-k3/k3-tiny.Q2_K.gguf", marks=pytest.mark.slow),  # situ, latent MoE, KDA
]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu runs these models through "
                                                                 "the kernels on CUDA; the interpreter is for CPUs")
TOKENS = [1, 5, 9, 200, 33, 17, 4, 81, 2, 77, 300, 12, 8, 64, 3, 5, 19, 250]  # prefill: trunk through cuBLAS


@pytest.mark.parametrize("path", MODELS)
def test_kernels_give_the_torch_paths_logits(path: str) -> None:
    engine = Engine.load(FIXTURES / path, resident_experts=True)
    want = engine.forward(TOKENS, engine.new_cache())
    with kernels_on_cpu():
        cache = engine.new_cache()
        got = torch.cat([engine.forward(TOKENS[:16], cache), engine.forward(TOKENS[16:17], cache),
                         engine.forward(TOKENS[17:], cache)])
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{path}: max |diff| {err:.2e} (mean {(got - want).abs().mean().item():.2e})"
