"""The KV buffers an engine's captured graphs read, across requests (on the CPU): the engine's
arena gives each live sequence a slot, and a slot's graphs (the decode step's, a short prompt's
per length) are captured over that slot's buffers, which stay with the slot. A request that opens
after another closed gets the same slot, and replays what was captured there; a graph whose
buffers were replaced since (a sequence reserved further, a long prompt growing them) is captured
anew. Here a recorder stands in for the CUDA graph: its "capture" notes where the buffers lie and
each "replay" first checks that the slot still holds exactly those, then runs the static pass
eagerly (torch's path: what tests/gpu replays as graphs on a GPU). Sequences alive together, a
second turn, a reservation outgrown, a long prompt, a reused slot's one-token prompt: no replay
over foreign buffers, every logit equal to the same requests run without graphs, and a graph
captured again only where its buffers went."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from expertpack.worker.engine import engine as engine_module
from expertpack.worker.engine.arena import Sequence
from expertpack.worker.engine.engine import Engine
from expertpack.worker.nn.layers import KVCache

from ..conftest import FIXTURES

MODEL = FIXTURES / "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf"


class ReplayRecorder:
    """engine.DecodeGraph's part, recorded: a 'capture' runs nothing (as CUDA's) but an empty
    cache's first pass, which makes its buffers; a 'replay' checks the buffers, then runs the pass."""

    captures: Counter = Counter()

    def __init__(self, model, cache: KVCache, device: torch.device, tokens: int = 1, last: bool = False,
                 pool: object = None) -> None:
        self.model, self.cache, self.last, self.tokens = model, cache, last, tokens
        self.capacity = cache.capacity
        if not cache.keys:
            self._pass(torch.zeros(tokens, dtype=torch.int64))
            cache.length -= tokens
        self.buffers = cache.buffer_ptrs()
        ReplayRecorder.captures[tokens] += 1

    def _pass(self, ids: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cache.step_positions = torch.arange(cache.length, cache.length + ids.shape[0])
        try:
            return self.model.forward(ids, cache, self.last).to(torch.float32)
        finally:
            cache.step_positions = None

    def step(self, tokens: int | list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens] if isinstance(tokens, int) else tokens, dtype=torch.int64)
        assert ids.shape[0] == self.tokens
        assert self.cache.buffer_ptrs() == self.buffers, "a graph replayed over buffers it was not captured over"
        return self._pass(ids)


@pytest.fixture
def on_cpu_with_graphs(monkeypatch: pytest.MonkeyPatch):
    """The engine's GPU branches on the CPU: static passes (torch's path), 'graphs' recorded;
    small reservations so that a few tokens cross them."""
    monkeypatch.setattr(Engine, "static_steps", property(lambda self: self.model.static_decode))
    monkeypatch.setattr(engine_module, "DecodeGraph", ReplayRecorder)
    monkeypatch.setattr(engine_module.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(Engine, "_replayed_kind", lambda self: ReplayRecorder if self.graphs else None)
    monkeypatch.setattr(engine_module, "MIN_STATIC_CAPACITY", 16)
    monkeypatch.setattr(engine_module, "STATIC_PROMPT_MAX_TOKENS", 6)
    monkeypatch.setattr(engine_module, "STATIC_PROMPT_MAX_CAPACITY", 32)
    ReplayRecorder.captures.clear()


def requests(engine: Engine) -> list[torch.Tensor]:
    """Logits of interleaved requests; what each step exercises is said beside it."""
    out = []

    def prompt(seq: Sequence, tokens: list[int]) -> None:
        out.append(engine.forward(tokens, seq, last=True)[-1])

    def decode(seq: Sequence, n: int) -> None:
        for _ in range(n):
            out.append(engine.forward([int(out[-1].argmax())], seq)[-1])

    a, b = engine.new_sequence(), engine.new_sequence()  # slots 0 and 1
    prompt(a, [1, 5, 9, 200, 33])  # into an empty slot: 16 positions made, prompt graph 5 captured
    decode(a, 3)  # decode graph 1 captured over the same buffers
    prompt(b, [7, 1000, 3, 64])  # slot 1's own buffers: 4 captured there
    decode(b, 2)  # and its own decode graph
    decode(a, 2)  # slot 0's graph replays
    prompt(a, [12, 8, 64])  # a second turn's prompt, into the filled slot: 3 captured
    decode(a, 4)  # a outgrows its 16 positions: reserved for 32, slot 0's graphs captured anew
    prompt(a, [2, 7, 1])  # so 3 again (a replay here would read a's old buffers)
    b.close()
    c = engine.new_sequence()  # slot 1 again, cleared: its buffers and graphs kept
    assert c.slot == 1
    prompt(c, [3, 1, 4, 1])  # 4 replays over slot 1's buffers
    decode(c, 14)  # replays, then c outgrows 16 positions: captured anew
    d = engine.new_sequence()  # slot 2
    prompt(d, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])  # a long prompt, eagerly: slot 2's own 256 positions
    decode(d, 2)  # decode captured over slot 2's
    decode(a, 2)  # slot 0's graph replays
    a.close()
    e = engine.new_sequence()  # slot 0, cleared
    out.append(engine.forward([42], e)[-1])  # a one-token prompt into a slot with buffers: a replay
    decode(e, 1)
    prompt(e, [5, 5, 5, 5, 5, 5])  # 6 captured
    prompt(e, [6, 6, 6, 6, 6, 6])  # 6 replays
    prompt(e, [7] * 30)  # a long prompt, eagerly, past slot 0's 32 positions: its buffers grow
    decode(e, 1)  # captured anew over slot 0's grown buffers
    return out


@pytest.mark.slow
def test_graphs_replay_only_over_the_buffers_they_were_captured_over(on_cpu_with_graphs) -> None:
    graphed = Engine.load(MODEL, resident_experts=True)
    got = requests(graphed)
    captures = dict(ReplayRecorder.captures)
    eager = Engine.load(MODEL, resident_experts=True)
    eager.graphs = False
    want = requests(eager)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert captures == {5: 1, 4: 1, 3: 2, 6: 1, 1: 6}, captures
    assert len(graphed.arena.slots) == 3 and graphed.arena.in_use == 0  # dropped sequences gave theirs back


def test_a_failed_prompt_capture_leaves_the_decode_graphs(on_cpu_with_graphs, monkeypatch, caplog) -> None:
    """A prompt CUDA cannot capture runs eagerly, prompts after it too; decode steps keep theirs."""
    class Refusing(ReplayRecorder):
        def __init__(self, model, cache: KVCache, device: torch.device, tokens: int = 1, last: bool = False,
                     pool: object = None) -> None:
            if tokens > 1:
                raise RuntimeError("operation not permitted when stream is capturing")
            super().__init__(model, cache, device, tokens, last, pool)

    engine = Engine.load(MODEL, resident_experts=True)
    monkeypatch.setattr(engine_module, "DecodeGraph", Refusing)
    monkeypatch.setattr(Engine, "_replayed_kind", lambda self: Refusing)
    cache = engine.new_sequence()
    first = engine.forward([1, 5, 9], cache, last=True)
    assert "prompt not captured" in caplog.text and not engine.prompt_graphs and engine.graphs
    engine.forward([int(first[-1].argmax())], cache)
    assert isinstance(engine._graphs.get(0), Refusing) and not engine._prompt_graphs
    engine.forward([4, 2], cache, last=True)  # eagerly, without a new attempt
    assert caplog.text.count("prompt not captured") == 1
