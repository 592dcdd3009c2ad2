"""Resident decode steps replayed as CUDA graphs (skipped without a GPU; run on the device machine):
bit for bit the logits of the same static-shape step run eagerly (the expert cache's mode), across a
re-capture when the KV cache outgrows its reservation, for each expert activation the fixtures
hold; and within float32 rounding of the CPU's torch path. An empty cache's first step replays the
captured graph. Short prompts replay graphs of their lengths, bit for bit their eager static form."""

from __future__ import annotations

import random

import pytest
import torch

from expertpack.worker.engine.engine import Engine

from ..conftest import FIXTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = ["gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf", "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
          "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", "flagship/kimi-k3/k3-tiny.Q2_K.gguf",  # kimi: KDA states
          "flagship/deepseek4/dsv4-tiny.BF16.gguf"]  # DeepSeek-V4: compressed-attention buffers (HCA completes at 511)


def decode(engine: Engine, prompt: list[int], feed: list[int]) -> torch.Tensor:
    cache = engine.new_sequence()
    engine.forward(prompt, cache)
    return torch.stack([engine.forward([t], cache)[-1] for t in feed]).cpu()


@pytest.mark.parametrize("path", MODELS)
def test_graph_replays_equal_the_eager_static_steps(path: str) -> None:
    rng = random.Random(0)
    graphed = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    n_vocab = graphed.forward([1], graphed.new_sequence()).shape[-1]
    prompt = rng.choices(range(n_vocab), k=500)  # decoding crosses 512 positions: one re-capture
    feed = rng.choices(range(n_vocab), k=24)
    got = decode(graphed, prompt, feed)
    assert graphed._graphs.get(0) is not None and graphed._graphs.get(0).buffers[0][1] == 1024  # its capacity
    eager = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    eager.graphs = False
    want = decode(eager, prompt, feed)
    assert eager._graphs.get(0) is None
    assert torch.equal(got, want), f"{path}: max |diff| {(got - want).abs().max().item():.2e}"
    cpu = decode(Engine.load(FIXTURES / path, resident_experts=True), prompt[:40], feed[:6])
    on_gpu = decode(graphed, prompt[:40], feed[:6])
    err = (on_gpu - cpu).abs().max().item()
    print(f"{path}: graph vs CPU torch path, max |diff| {err:.2e}")
    assert err < 1e-4


def test_an_empty_caches_first_step_replays_the_graph() -> None:
    engine = Engine.load(FIXTURES / MODELS[0], "cuda", resident_experts=True)
    eager_first = engine.forward([1], engine.new_sequence())[-1].cpu()  # no graph yet: eagerly
    feed = [1, *random.Random(1).choices(range(eager_first.shape[-1]), k=7)]
    first = decode(engine, feed[:1], feed[1:])  # the steps after the one-token prompt capture the graph
    graph = engine._graphs.get(0)
    assert graph is not None
    cache = engine.new_sequence()
    steps = torch.stack([engine.forward([t], cache)[-1] for t in feed]).cpu()
    assert engine._graphs.get(0) is graph and graph.inputs.caches[0] is cache.kv, "the first step should replay, not capture"
    for got, want in ((steps[0], eager_first), (steps[1:], first)):
        assert torch.allclose(got, want, atol=1e-4, rtol=0), f"max |diff| {(got - want).abs().max().item():.2e}"


@pytest.mark.parametrize("path", MODELS[:3] + ["flagship/deepseek4/dsv4-tiny.Q2_K.gguf"])  # not Kimi-K3: its prompts run eagerly
def test_short_prompts_replay_graphs_equal_to_the_eager_static_prompts(path: str) -> None:
    """A generation's short prompt is a CUDA graph per length, captured at its first prompt and
    then replayed (a second request of that length, a second turn's prompt into a filled cache):
    bit for bit the same static-shape prompt run eagerly (the expert cache's mode); the decode
    graph and the prompt graphs read the buffers of the arena's slot that every request takes in
    turn, never captured twice."""
    rng = random.Random(2)
    graphed = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    n_vocab = graphed.forward([1], graphed.new_sequence()).shape[-1]
    requests = [rng.choices(range(n_vocab), k=n) for n in (2, 17, 64, 17)]
    turn = rng.choices(range(n_vocab), k=9)

    def run(engine: Engine) -> torch.Tensor:
        out = []
        for prompt in requests:
            with engine.new_sequence() as cache:  # each request in slot 0, where the graphs are
                logits = engine.forward(prompt, cache, last=True)
                out.append(logits[-1])
                for _ in range(3):
                    logits = engine.forward([int(logits[-1].argmax())], cache)
                    out.append(logits[-1])
                out.append(engine.forward(turn, cache, last=True)[-1])  # the next turn, into the same cache
        return torch.stack(out).cpu()

    got = run(graphed)
    assert sorted(graphed._prompt_graphs) == [(0, 2), (0, 9), (0, 17), (0, 64)]
    captured = graphed._graphs.get(0), dict(graphed._prompt_graphs)
    again = run(graphed)
    assert (graphed._graphs.get(0), graphed._prompt_graphs) == captured, "a prompt or the decode step was captured again"
    eager = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    eager.graphs = False
    want = run(eager)
    assert eager._graphs.get(0) is None and not eager._prompt_graphs
    for name, a in (("first run", got), ("second run", again)):
        assert torch.equal(a, want), f"{path}: {name}: max |diff| {(a - want).abs().max().item():.2e}"


@pytest.mark.parametrize("path", [MODELS[3], "flagship/deepseek4/dsv4-tiny.Q2_K.gguf"])
def test_a_second_request_with_states_replays_the_graph(path: str) -> None:
    """Sequences with an architecture's own states (KDA's, DeepSeek-V4's compressors) leave them in
    their arena slot, cleared in place for the next: the next request of the same reservation
    replays the captured step, bit for bit the eager static steps."""
    rng = random.Random(3)
    graphed = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    n_vocab = graphed.forward([1], graphed.new_sequence()).shape[-1]
    prompts = [rng.choices(range(n_vocab), k=n) for n in (30, 21)]
    feed = rng.choices(range(n_vocab), k=8)
    first = decode(graphed, prompts[0], feed)
    graph = graphed._graphs.get(0)
    second = decode(graphed, prompts[1], feed)
    assert graph is not None and graphed._graphs.get(0) is graph, "the second request was captured again"
    eager = Engine.load(FIXTURES / path, "cuda", resident_experts=True)
    eager.graphs = False
    for prompt, got in zip(prompts, (first, second)):
        want = decode(eager, prompt, feed)
        assert torch.equal(got, want), f"{path}: max |diff| {(got - want).abs().max().item():.2e}"
