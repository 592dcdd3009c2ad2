"""Batched decode steps (Engine.decode_batch, issue 35's continuous batching): several sequences'
next tokens in one step, sequences joining after their own prefill and leaving when done, a slot
given back and taken by a newcomer mid-run. Each sequence's greedy tokens equal its run alone and
its logits equal its own eager steps': bit for bit through the kernels under Triton's interpreter
(each row computed apart; the fixtures' experts are one chunk of K, never split), within float32
rounding on the torch path (all rows in one matrix product), on the GQA architectures of the
fixtures (qwen3moe, Mixtral, gpt-oss with its sliding window and sinks). tests/gpu runs it on CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from expertpack.worker.engine.engine import BatchUnsupported, Engine
from expertpack.worker.nn.backend import kernels_on_cpu

from ..conftest import FIXTURES
from ..helpers.batched import MODELS, SCENARIOS, alone, batched, prefill

@pytest.mark.parametrize("model,fast", [(m, False) for m in sorted(MODELS)]
                         + [pytest.param("qwen3moe", True, marks=[pytest.mark.slow, pytest.mark.filterwarnings(
                             "ignore:Conversion of an array with ndim > 0:DeprecationWarning")])],
                         ids=[f"{m}-torch" for m in sorted(MODELS)] + ["qwen3moe-kernels"])
def test_batched_steps_give_each_sequence_its_own_tokens(model: str, fast: bool) -> None:
    scenario = SCENARIOS["kernels" if fast else "torch"]
    with kernels_on_cpu() if fast else contextlib.nullcontext():
        engine = Engine.load(FIXTURES / MODELS[model], resident_experts=True)
        assert engine.place.ops.kernels == fast
        want = {name: alone(engine, name, steps) for name, (_, steps) in scenario.items()}
        got = batched(engine, scenario)
    assert engine.arena.in_use == 0 and len(engine.arena.slots) == (2 if fast else 3)  # d reused a's slot
    for name in scenario:
        assert got[name][0] == want[name][0], f"{model} {name}: greedy tokens differ"
        for step, (g, w) in enumerate(zip(got[name][1], want[name][1], strict=True)):
            if fast:
                assert torch.equal(g, w), f"{model} {name} step {step}: max |diff| {(g - w).abs().max():.3g}"
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=2e-5, msg=f"{model} {name} step {step}")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_prompt_beside_running_sequences_gives_each_its_own_tokens(model: str) -> None:
    """Mixed steps (Engine.mixed_step, continuous batching while prompts are admitted): two
    newcomers' prompts in one step with the running sequences' next tokens. Each sequence's greedy tokens are
    its own alone, its logits its own eager steps' within float32 rounding. DeepSeek-V4's
    sequences keep compressed states a static step updates in place: it says it does not mix."""
    engine = Engine.load(FIXTURES / MODELS[model], resident_experts=True)
    scenario = SCENARIOS["torch"]
    if model == "deepseek4":
        with engine.new_sequence() as running, engine.new_sequence() as newcomer:
            prefill(engine, running, [1, 5, 9])
            assert not engine.mixes([newcomer, running])
            with pytest.raises(BatchUnsupported, match="keep no states"):
                engine.mixed_step([(newcomer, [4, 81])], [running], [3])
        return
    want = {name: alone(engine, name, steps) for name, (_, steps) in scenario.items()}
    got = batched(engine, scenario, mixed=True)
    assert engine.arena.in_use == 0
    for name in scenario:
        assert got[name][0] == want[name][0], f"{model} {name}: greedy tokens differ"
        for step, (g, w) in enumerate(zip(got[name][1], want[name][1], strict=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-5, msg=f"{model} {name} step {step}")


def test_a_mixed_step_checks_what_it_is_given() -> None:
    """A token for each running sequence, a piece for each prompt, every sequence once: else
    nothing runs and no cache moves."""
    engine = Engine.load(FIXTURES / MODELS["qwen3moe"], resident_experts=True)
    with engine.new_sequence() as a, engine.new_sequence() as b, engine.new_sequence() as c:
        prefill(engine, a, [1, 5])
        for pieces, seqs, tokens in (([(b, [4, 81])], [a], []), ([(a, [4])], [a], [3]),
                                     ([(b, [4]), (b, [5])], [a], [3]), ([(b, [4]), (c, [])], [a], [3]), ([], [a], [3])):
            with pytest.raises(ValueError, match="a token for each"):
                engine.mixed_step(pieces, seqs, tokens)
        assert (a.kv.length, b.kv.length, c.kv.length) == (2, 0, 0)


def test_a_model_of_one_sequence_a_step_says_so() -> None:
    engine = Engine.load(FIXTURES / "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", resident_experts=True)
    with engine.new_sequence() as seq, pytest.raises(BatchUnsupported, match="deepseek2: .*qwen3moe"):
        engine.decode_batch([seq], [1])


@pytest.mark.parametrize("mixed", [False, True], ids=["batched", "mixed"])
def test_batched_steps_through_a_minimal_cache_equal_resident_ones(fixture_packs, tmp_path, mixed: bool) -> None:
    """Streaming: a batched step's rows pick up to rows x k experts a layer, from a cache of one
    layer's k (through a real expertd), delivered in waves: the very bits of every expert resident;
    so do mixed steps, a newcomer's prompt beside the running rows."""
    from ..helpers.engine import resident_and_minimal_cache

    scenario = SCENARIOS["torch"]
    want, got = resident_and_minimal_cache(fixture_packs["qwen3moe-a.Q4_K_M"][1], tmp_path,
                                           lambda engine: batched(engine, scenario, mixed))
    for name in scenario:
        assert got[name][0] == want[name][0], f"{name}: greedy tokens differ"
        for step, (g, w) in enumerate(zip(got[name][1], want[name][1], strict=True)):
            assert torch.equal(g, w), f"{name} step {step}: max |diff| {(g - w).abs().max():.3g}"
