"""The decode step a CUDA graph captures, run eagerly: with the KV cache's buffers reserved ahead and
the token's position a device tensor (`step_positions`), a step attends over the whole buffer masked
by position (its sums run over more, masked keys: equal within float32 rounding). For every architecture that declares `static_decode`, such steps give the eager
decode's logits, step after step, and leave the cache where eager decoding leaves it. (tests/gpu
replays the captured graphs themselves.)"""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine.arena import SequenceClosed
from expertpack.worker.engine.engine import Engine
from expertpack.worker.nn.layers import KVCache

from ..conftest import FIXTURES
from ..helpers.engine import static_steps

MODELS = {  # one GGUF per architecture that declares static_decode
    "qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",
    "llama": "gguf/mixtral-a/mixtral-a.Q4_K_M.gguf",
    "gpt-oss": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
    "deepseek2": "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf",
    "kimi-k3": "flagship/kimi-k3/k3-tiny.Q2_K.gguf",  # KDA states updated in place
    "deepseek4": "flagship/deepseek4/dsv4-tiny.BF16.gguf",  # compressed-attention buffers updated in place
}
PROMPT, FEED = [1, 5, 9, 200], [33, 7, 1000]
CASES = {arch: (arch, PROMPT, FEED) for arch in MODELS}
# DeepSeek-V4's tiny model (window 32, CSA 4, HCA 128): steps at 122..131 go round the sliding
# window's ring, complete three CSA windows (after the prompt's 30 entries, more than the
# indexer's top 4) and HCA's first window.
CASES["deepseek4-long"] = ("deepseek4", [(7 * i + 1) % 1000 for i in range(122)],
                           [33, 7, 1000, 5, 9, 200, 71, 3, 512, 64])
CASES["deepseek4-first-windows"] = ("deepseek4", PROMPT[:2], FEED + FEED[::-1])  # CSA's first without an overlap


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_steps_equal_eager_decode(case: str) -> None:
    arch, prompt, feed = CASES[case]
    engine = Engine.load(FIXTURES / MODELS[arch], resident_experts=True)
    assert engine.model.static_decode
    eager = engine.new_sequence()
    engine.forward(prompt, eager)
    want = torch.cat([engine.forward([t], eager) for t in feed])

    static = engine.new_sequence()
    engine.forward(prompt, static)
    static.kv.reserve(300)  # buffers longer than the sequence: the unwritten rows must not count
    got = static_steps(engine, static.kv, feed)
    assert static.length == eager.length == len(prompt) + len(feed)
    err = (got - want).abs().max().item()
    assert err < 1e-5, f"{case}: max |diff| {err:.2e}"
    for layer in eager.kv.keys:  # the same keys in the same rows (the summation order over keys differs)
        torch.testing.assert_close(static.kv.keys[layer][:eager.length], eager.kv.keys[layer][:eager.length],
                                   rtol=1e-5, atol=1e-5)
    eager.kv.reserve(300)  # states reserved after eager decoding hold what the static steps left
    for mine, theirs in zip(static.kv.state_tensors(), eager.kv.state_tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3moe", "kimi-k3", "deepseek4"])
def test_a_reused_slot_keeps_its_buffers_and_starts_clean(arch: str) -> None:
    """A captured step reads fixed buffers: a request's sequence closes, the next one opens in the
    same arena slot, over the same buffers, its rows and its architecture's states (KDA's,
    DeepSeek-V4's compressors) cleared in place. It decodes as a fresh engine's first sequence:
    bit for bit where the states have one shape (keys reserved or not are read the same), within
    float32 rounding for DeepSeek-V4, whose reserved states an eager pass rebuilds."""
    engine = Engine.load(FIXTURES / MODELS[arch], resident_experts=True)
    with engine.new_sequence() as first:
        engine.forward(PROMPT[::-1] + [7], first)
        engine.forward([FEED[1]], first)
        first.kv.reserve(300)
        held, slot = first.kv.buffer_ptrs(), first.slot
        assert bool(first.kv.state) == (arch != "qwen3moe")
    second = engine.new_sequence()
    assert second.slot == slot and second.length == 0 and second.kv.buffer_ptrs() == held
    got = torch.cat([engine.forward(PROMPT, second), engine.forward([FEED[0]], second)])
    assert second.kv.buffer_ptrs() == held
    fresh_engine = Engine.load(FIXTURES / MODELS[arch], resident_experts=True)
    fresh = fresh_engine.new_sequence()
    want = torch.cat([fresh_engine.forward(PROMPT, fresh), fresh_engine.forward([FEED[0]], fresh)])
    if arch == "deepseek4":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)
    with pytest.raises(SequenceClosed):
        engine.forward([FEED[0]], first)


def test_deepseek4_state_stays_in_its_buffers_between_eager_and_static_passes() -> None:
    """Once reserved, DeepSeek-V4's layer states live in their buffers: an eager pass of several
    tokens between static steps starts from them and writes its result back into the same
    tensors (a captured step keeps reading those), or into larger ones where it goes past their
    capacity; a larger reservation moves them too. The prompt passes HCA's first window, whose
    entry the first reservation moves."""
    engine = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)
    prompt = [(5 * i + 2) % 1000 for i in range(130)]
    # (No step at an indexer tie: there eager and static picks may differ, either being right.)
    first, chunks, last = [33, 7, 1000, 5, 9, 200], ([71, 3, 512], [12, 640, 6]), [64, 18, 301]
    eager = engine.new_sequence()
    engine.forward(prompt, eager)
    want = torch.cat([engine.forward([t], eager) for t in first] + [engine.forward(c, eager) for c in chunks]
                     + [engine.forward([t], eager) for t in last])

    static = engine.new_sequence()
    engine.forward(prompt, static)
    static.kv.reserve(140)
    buffers = static.kv.state_tensors()
    got = [static_steps(engine, static.kv, first), engine.forward(chunks[0], static)]  # up to 139: in place
    assert all(a is b for a, b in zip(buffers, static.kv.state_tensors(), strict=True))
    got.append(engine.forward(chunks[1], static))  # up to 142: grown
    assert static.kv.capacity == 280
    static.kv.reserve(300)
    assert static.kv.capacity == 300
    got = torch.cat(got + [static_steps(engine, static.kv, last)])
    err = (got - want).abs().max().item()
    ties = sorted({p for state in static.kv.state.values() for p in state.ties()})
    assert err < 1e-5, f"max |diff| {err:.2e} (indexer ties at {ties})"


def static_pass(engine: Engine, cache: KVCache, tokens: list[int]) -> torch.Tensor:
    """Logits [1, V] after a pass of several tokens at device positions, as a captured prompt runs."""
    cache.step_positions = torch.arange(cache.length, cache.length + len(tokens))
    try:
        with torch.inference_mode():
            return engine.model.forward(torch.tensor(tokens), cache, True).to(torch.float32)
    finally:
        cache.step_positions = None


# DeepSeek-V4's tiny model: window 32, CSA 4 (indexer top 4), HCA 128. Passes of up to 64 tokens
# (engine.STATIC_PROMPT_MAX_TOKENS) static, longer ones eager, each into the cache the last left.
STATIC_PASSES = {
    "empty cache, CSA's first windows": (False, [2, 1, 1, 7, 5]),
    "passes that complete windows and go round the ring": (True, [40, 33, 1, 1]),
    "HCA's first window completed inside a pass": (True, [64, 60, 9, 1]),
    "after a long eager prompt, with the indexer's picks": (False, [122, 9, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(STATIC_PASSES))
def test_deepseek4_static_passes_of_several_tokens_equal_eager_passes(case: str) -> None:
    """A short prompt with static shapes (what engine captures as a CUDA graph per prompt length):
    into an empty cache whose states the model made before any token (new_states), and into a
    filled one; each compressor completes the windows the pass fills. Every pass gives the eager
    pass's logits, and the states end where eager passes leave them. Where `wide`, the indexer
    picks every entry: its top-k often ties (scores of exactly 0 after ReLU), where eager and
    static picks may differ, either being right, and a different pick changes everything after it."""
    import dataclasses

    wide, plan = STATIC_PASSES[case]
    engine = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)
    if wide:
        engine.model.shapes = [dataclasses.replace(s, index_topk=10 ** 6) for s in engine.model.shapes]
    stream = [(7 * i + 1) % 1000 for i in range(sum(plan))]
    eager, static = engine.new_sequence(), engine.new_sequence()
    static.kv.state.update(engine.model.new_states())
    static.kv.reserve(256)
    assert static.kv.capacity == 256 and static.length == 0
    start = 0
    for n in plan:
        tokens, start = stream[start:start + n], start + n
        with torch.inference_mode():
            want = engine.model.forward(torch.tensor(tokens), eager.kv, True).to(torch.float32)
            got = static_pass(engine, static.kv, tokens) if n <= 64 else engine.model.forward(
                torch.tensor(tokens), static.kv, True).to(torch.float32)
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"{case}: pass of {n} tokens ending at {start}: max |diff| {err:.2e}"
    assert static.length == eager.length == sum(plan)
    eager.kv.reserve(256)
    for mine, theirs in zip(static.kv.state_tensors(), eager.kv.state_tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_engines_short_prompt_into_an_empty_deepseek4_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine runs a generation's short prompt with static shapes wherever its kernels run
    (here told they do, the model's arithmetic staying torch's): an empty DeepSeek-V4 cache gets
    the model's states before any token and a reservation, then a second turn's prompt and decode
    steps continue it; the logits are those of eager passes."""
    from expertpack.worker.engine import engine as engine_module

    engine = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)
    prompt, turn = [(3 * i + 11) % 1000 for i in range(21)], [5, 9, 200, 33, 7]
    eager = engine.new_sequence()
    want = [engine.forward(prompt, eager, last=True), engine.forward(turn, eager, last=True),
            engine.forward([64], eager)]
    monkeypatch.setattr(Engine, "static_steps", property(lambda self: self.model.static_decode))
    cache = engine.new_sequence()
    got = [engine.forward(prompt, cache, last=True)]
    assert cache.kv.capacity == engine_module.MIN_STATIC_CAPACITY and cache.length == 21
    assert all(state.buffers is not None for state in cache.kv.state.values())
    got += [engine.forward(turn, cache, last=True), engine.forward([64], cache)]
    err = (torch.cat(got) - torch.cat(want)).abs().max().item()
    assert err < 1e-5, f"max |diff| {err:.2e}"


def test_a_deepseek4_slot_left_by_an_eager_pass_takes_a_static_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence that ran only eagerly (a one-token prompt: its DeepSeek-V4 states unreserved)
    leaves its slot; the next sequence there starts with a static short prompt (static steps forced
    on, the arithmetic staying torch's), whose reservation needs the cleared states'
    device: the logits are a fresh engine's."""
    prompt = [(3 * i + 11) % 1000 for i in range(21)]
    fresh = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)
    monkeypatch.setattr(Engine, "static_steps", property(lambda self: self.model.static_decode))
    want = fresh.forward(prompt, fresh.new_sequence(), last=True)
    engine = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)
    with engine.new_sequence() as first:
        engine.forward([1], first)  # eagerly: a one-token prompt into an empty slot
        assert all(state.buffers is None for state in first.kv.state.values())
    second = engine.new_sequence()
    got = engine.forward(prompt, second, last=True)
    assert all(state.buffers is not None for state in second.kv.state.values()), "the prompt ran eagerly"
    assert torch.equal(got, want)


def test_deepseek4_short_prompt_through_a_minimal_expert_cache_equals_every_expert_resident(
        fixture_packs, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's static-shape prompt (static steps forced on, the arithmetic staying torch's) with
    DeepSeek-V4's experts streamed through expertd into a cache of one layer's step: its experts
    come in waves, its hash-routed layers' too, evicted at every layer; the prompt's logits and a
    second turn's equal every expert resident, bit for bit. (The decode steps between, CUDA graphs
    split at the MoE layers with the cache, need the kernels: tests/kernels and tests/gpu.)"""
    from ..helpers.engine import resident_and_minimal_cache

    monkeypatch.setattr(Engine, "static_steps", property(lambda self: self.model.static_decode))
    prompt = [(7 * i + 1) % 1000 for i in range(21)]

    def run(engine: Engine) -> torch.Tensor:
        cache = engine.new_sequence()
        first = engine.forward(prompt, cache, last=True)
        assert all(state.buffers is not None for state in cache.kv.state.values()), "the prompt ran eagerly"
        return torch.cat([first, engine.forward(prompt[:9], cache, last=True)])

    want, got = resident_and_minimal_cache(fixture_packs["dsv4-tiny.Q2_K"][1], tmp_path, run)
    assert torch.equal(got, want)
