"""The fast path wired into whole models: every linear and every MoE layer through the Triton
kernels (here under Triton's interpreter, on CUDA in tests/gpu) gives the logits of the torch path
on real llama.cpp files, through a prefill and decode steps (static shapes), within float32 rounding
(the kernels sum in another order); the reference logits' std is ~1."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.kernels.linear_tl import MATVEC_MAX_ROWS
from expertpack.worker.nn.backend import kernels_on_cpu

from ..conftest import FIXTURES, IQ_FIXTURES

MODELS = [  # one of each expert activation and weight family the fixtures hold
    "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",  # SwiGLU, Q4_K/Q6_K, GQA with q/k norms
    pytest.param("gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf", marks=pytest.mark.slow),  # clamped SwiGLU, biases, MXFP4
    pytest.param("gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", marks=pytest.mark.slow),  # MLA, shared experts, Q2_K/Q3_K
    pytest.param("flagship/deepseek4/dsv4-tiny.Q2_K.gguf", marks=pytest.mark.slow),  # clamped SwiGLU per layer, mHC
    pytest.param("flagship/kimi-k3/k3-tiny.Q2_K.gguf", marks=pytest.mark.slow),  # situ, latent MoE, KDA
    # llama.cpp's i-quant mixes (tests/fixtures/iq, the repository's own): every IQ and TQ type
    pytest.param(str(IQ_FIXTURES / "qwen3moe-a.IQ-mix.gguf"), marks=pytest.mark.slow),  # IQ1_S .. IQ3_XXS
    pytest.param(str(IQ_FIXTURES / "deepseek3-a.IQ-mix.gguf"), marks=pytest.mark.slow),  # IQ3_S, IQ4, TQ
    pytest.param(str(IQ_FIXTURES / "mixtral-a.IQ-mix.gguf"), marks=pytest.mark.slow),  # IQ1_M, IQ2_S
]
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu runs these models through "
                                                                  "the kernels on CUDA; the interpreter is for CPUs"),
              pytest.mark.usefixtures("interpreter_tiles")]
TOKENS = [1, 5, 9, 200, 33, 17, 4, 81, 2, 77, 300, 12, 8, 64, 3, 5, 19, 250]


@pytest.mark.parametrize("path", MODELS)
def test_kernels_give_the_torch_paths_logits(path: str) -> None:
    """A prompt, then two decode steps, through the kernels: the torch path's logits. The prompt
    has more rows than the trunk's matvec takes, so its trunk is dequantized and multiplied (the
    matvec of several rows is test_linear_kernels', where the interpreter's time is seconds, not
    minutes: a 16-row matvec of deepseek3-a's IQ3_S trunk took 2 of this test's 2.6 minutes)."""
    tokens, prompt = TOKENS + [7], MATVEC_MAX_ROWS + 1
    engine = Engine.load(FIXTURES / path, resident_experts=True)
    want = engine.forward(tokens, engine.new_sequence())
    with kernels_on_cpu():
        engine = Engine.load(FIXTURES / path, resident_experts=True)  # its ops: the kernels
        cache = engine.new_sequence()
        got = torch.cat([engine.forward(tokens[:prompt], cache), engine.forward(tokens[prompt:prompt + 1], cache),
                         engine.forward(tokens[prompt + 1:prompt + 2], cache)])
    assert got.shape[0] == len(tokens) == prompt + 2
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{path}: max |diff| {err:.2e} (mean {(got - want).abs().mean().item():.2e})"


def test_minimal_cache_through_the_kernels_is_bit_exact(fixture_packs, tmp_path) -> None:
    """The expert cache on the fast path: a cache of one step of one layer delivers prefill in waves
    (a subset of the pairs per launch) and evicts at every layer; the logits equal every expert
    resident bit for bit, through prefill and static decode steps."""
    from ..helpers.engine import greedy_run, resident_and_minimal_cache

    with kernels_on_cpu():
        (want_logits, want_tokens), (got_logits, got_tokens) = resident_and_minimal_cache(
            fixture_packs["qwen3moe-a.Q4_K_M"][1], tmp_path, lambda engine: greedy_run(engine, TOKENS[:12], 3))
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        assert torch.equal(got, want), f"step {step} differs from the resident run"


def test_static_steps_cross_reservations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine's decode steps on the fast path reserve the KV cache ahead (powers of two) and grow it
    when a step reaches the end; crossing two reservations, the logits stay the torch path's."""
    from expertpack.worker.engine import engine as engine_module
    from expertpack.worker.nn import layers

    monkeypatch.setattr(engine_module, "MIN_STATIC_CAPACITY", 4)
    monkeypatch.setattr(layers, "INITIAL_CAPACITY", 3)
    path = FIXTURES / "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf"
    engine = Engine.load(path, resident_experts=True)
    want = engine.forward(TOKENS[:11], engine.new_sequence())[2:]
    with kernels_on_cpu():
        engine = Engine.load(path, resident_experts=True)
        cache = engine.new_sequence()
        got = [engine.forward(TOKENS[:3], cache)[-1:]]
        capacities = []
        for t in TOKENS[3:11]:
            got.append(engine.forward([t], cache))
            capacities.append(cache.kv.capacity)
    assert capacities == [4, 8, 8, 8, 8, 16, 16, 16]  # a power of two above the length, doubled when reached
    err = (torch.cat(got)[:-1] - want[:-1]).abs().max().item()
    assert err < 1e-4, f"max |diff| {err:.2e}"


@pytest.mark.slow
def test_short_prompts_with_static_shapes_give_the_torch_paths_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation's short prompt on the fast path takes the decode step's static shapes (keys
    written at device positions, attention over the reserved buffers masked by position: what a
    CUDA graph per prompt length replays on a GPU): into an empty cache, then a second turn's
    prompt into the filled one, whose reservation it outgrows; logits within float32 rounding of
    the torch path's, and the decode step after them too."""
    from expertpack.worker.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "MIN_STATIC_CAPACITY", 16)
    path = FIXTURES / "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf"
    engine = Engine.load(path, resident_experts=True)
    want = engine.forward(TOKENS + TOKENS[:17], engine.new_sequence())
    with kernels_on_cpu():
        engine = Engine.load(path, resident_experts=True)
        cache = engine.new_sequence()
        got = [engine.forward(TOKENS, cache, last=True)]
        assert (cache.length, cache.kv.capacity, cache.kv.reserved) == (18, 32, 32)  # reserved: the static path's
        got.append(engine.forward(TOKENS[:16], cache, last=True))
        assert (cache.length, cache.kv.capacity, cache.kv.reserved) == (34, 64, 64)
        got.append(engine.forward(TOKENS[16:17], cache))
    err = (torch.cat(got) - want[[17, 33, 34]]).abs().max().item()
    assert err < 1e-4, f"max |diff| {err:.2e}"


@pytest.mark.slow
def test_a_short_prompt_through_a_minimal_cache_is_bit_exact(fixture_packs, tmp_path) -> None:
    """The static-shape prompt (a generation's: logits of its last token) with the expert cache,
    whose prefill comes in waves, equals every expert resident bit for bit, as a decode step does."""
    from ..helpers.engine import resident_and_minimal_cache

    def run(engine: Engine) -> torch.Tensor:
        cache = engine.new_sequence()
        first = engine.forward(TOKENS[:12], cache, last=True)
        return torch.cat([first, engine.forward([int(first[-1].argmax())], cache)])

    with kernels_on_cpu():
        want, got = resident_and_minimal_cache(fixture_packs["qwen3moe-a.Q4_K_M"][1], tmp_path, run)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_deepseek4_decode_steps_through_windows_give_the_torch_paths_logits() -> None:
    """DeepSeek-V4's static decode steps on the fast path (the compressors in two launches each,
    the key mask, the masked attention) at positions 124..127 after a long prompt: the raw ring
    has wrapped, the indexer picks among more entries than its top-k, and the last step completes
    a CSA window and HCA's first; the logits stay the torch path's eager decode's and the state
    buffers end where eager decoding leaves them. ~1 min."""
    from ..helpers.engine import static_steps

    path = FIXTURES / "flagship/deepseek4/dsv4-tiny.BF16.gguf"
    engine = Engine.load(path, resident_experts=True)
    prompt, feed = [(7 * i + 1) % 1000 for i in range(124)], [33, 7, 1000, 5]
    eager = engine.new_sequence()
    engine.forward(prompt, eager)
    want = torch.cat([engine.forward([t], eager) for t in feed])
    static = engine.new_sequence()
    engine.forward(prompt, static)
    static.kv.reserve(160)
    with kernels_on_cpu():  # the torch path's prefill, then the kernels' steps over its cache
        got = static_steps(Engine.load(path, resident_experts=True), static.kv, feed)
    err = (got - want).abs().max().item()
    assert err < 1e-5, f"max |diff| {err:.2e}"
    eager.kv.reserve(160)
    for mine, theirs in zip(static.kv.state_tensors(), eager.kv.state_tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
