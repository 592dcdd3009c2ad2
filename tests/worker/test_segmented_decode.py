"""The decode step over the expert cache split at its MoE layers (engine.SegmentedDecode), on the
CPU: the segments run eagerly under Triton's interpreter with the stops, static buffers and host
steps that the CUDA graphs replay between (tests/gpu replays the graphs themselves). Against a
real expertd, with a cache of the minimum size (it evicts at every layer):

- step after step, the logits, greedy tokens and cache counters of the eager streaming step,
  bit for bit, with prefetch on and off, across a new reservation and a second request (the stops'
  buffers kept in the arena's slot, or made anew where DecodeGraph would capture again);
- a segmented step reads the device once per MoE layer (its ids and the lookahead's guess
  together), where the eager step reads it twice;
- every MoE layer is a stop, in order, and every stop reads the same offsets buffer each step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from expertpack.worker.engine import engine as engine_module
from expertpack.worker.engine.engine import Engine, SegmentedDecode
from expertpack.worker.nn.backend import kernels_on_cpu

from ..helpers.engine import daemon_for, greedy_run, minimal_cache_bytes

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu replays the graphs; "
                                                                  "the interpreter is for CPUs"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.usefixtures("interpreter_tiles", "short_reservations")]
PROMPT = [1, 5, 9]  # the interpreter takes seconds a token
N_STEPS = 3
# (pack, prefetch): every layer MoE; DeepSeek-V4, whose hash layers' experts the graphs look up
# from their token buffer. Each interpreter run takes one to four minutes: without prefetch, and
# the other architectures (a dense leading layer with shared experts, a router that reads another
# input than the experts), are replayed as graphs on the GPU (tests/gpu/test_segmented_graphs.py).
CASES = [("qwen3moe-a.Q4_K_M", True), ("dsv4-tiny.Q2_K", True)]


def counters(engine: Engine) -> tuple[int, ...]:
    c = engine.expert_cache.counters
    return c.hits, c.misses, c.evictions, c.h2d_bytes, c.prefetch_issued


def streamed(pack: Path, endpoint: str, prefetch: bool, graphs: bool) -> Engine:
    engine = Engine.load(pack, daemon=endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=prefetch)
    engine.graphs = graphs
    return engine


@pytest.mark.parametrize(("name", "prefetch"), CASES)
def test_segments_give_the_eager_steps_bits(name: str, prefetch: bool, fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[name][1]
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            eager = streamed(pack, d.endpoint, prefetch, graphs=False)
            try:
                want, want_tokens = greedy_run(eager, PROMPT, N_STEPS)
                want_counters = counters(eager)
                assert eager._graphs.get(0) is None
            finally:
                eager.close()
            engine = streamed(pack, d.endpoint, prefetch, graphs=True)
            try:
                got, got_tokens = greedy_run(engine, PROMPT, N_STEPS)
                segmented = engine._graphs.get(0)
                assert isinstance(segmented, SegmentedDecode) and not segmented.graphs  # eager segments on the CPU
                assert counters(engine) == want_counters
                moe_layers = engine.expert_cache.served
                assert [s.layer for s in segmented.stops] == moe_layers
                assert all(bool(s.targets) == prefetch for s in segmented.stops[:-1])
                assert not segmented.stops[-1].targets  # nothing ahead of the last layer
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    assert got_tokens == want_tokens
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{name}: step {step} differs from the eager streaming step"


def test_one_device_read_per_moe_layer(fixture_packs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of a tensor's values into Python (tolist, item) is a host sync on a GPU: a
    segmented step makes one per MoE layer, and its stops' buffers are the same every step."""
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_for(pack, tmp_path)
    reads: list[str] = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counted_tolist(t: torch.Tensor):
        reads.append("tolist")
        return tolist(t)

    def counted_item(t: torch.Tensor):
        reads.append("item")
        return item(t)

    try:
        with kernels_on_cpu():
            for graphs in (False, True):
                engine = streamed(pack, d.endpoint, prefetch=True, graphs=graphs)
                try:
                    n_moe = len(engine.expert_cache.served)
                    cache = engine.new_sequence()
                    engine.forward(PROMPT, cache)
                    engine.forward([3], cache)  # the segments' first step: their buffers are made
                    buffers = [s.offsets for s in engine._graphs.get(0).stops] if graphs else []
                    with monkeypatch.context() as m:
                        m.setattr(torch.Tensor, "tolist", counted_tolist)
                        m.setattr(torch.Tensor, "item", counted_item)
                        for token in (7, 11):
                            reads.clear()
                            engine.forward([token], cache)
                            # eager: the layer's ids, and apart from them the guesses of all but the last layer
                            assert len(reads) == (n_moe if graphs else 2 * n_moe - 1), (graphs, reads)
                    if graphs:
                        assert all(a is s.offsets for a, s in zip(buffers, engine._graphs.get(0).stops, strict=True))
                finally:
                    engine.close()
    finally:
        assert d.stop()[0] == 0


def test_new_reservations_and_requests_stay_exact(fixture_packs, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding crosses a reservation (the segments made anew, as DecodeGraph captures anew), and a
    second request opens in the first one's arena slot (its segments kept); both stay bit-exact."""
    monkeypatch.setattr(engine_module, "MIN_STATIC_CAPACITY", 4)
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_for(pack, tmp_path)
    runs: dict[bool, list] = {}
    seen: list[SegmentedDecode] = []
    try:
        with kernels_on_cpu():
            for graphs in (False, True):
                engine = streamed(pack, d.endpoint, prefetch=True, graphs=graphs)
                try:
                    first = greedy_run(engine, PROMPT, 2)  # positions 3, 4: capacity 4, then 8
                    if graphs:
                        seen.append(engine._graphs.get(0))
                        assert engine._graphs.get(0).buffers[0][1] == 8  # its capacity
                    second = greedy_run(engine, PROMPT[::-1] + [2, 4], 2)  # positions 5, 6: 8 again, the same slot
                    if graphs:
                        assert engine._graphs.get(0) is seen[0]
                    runs[graphs] = [*first[0], *second[0]], first[1] + second[1]
                finally:
                    engine.close()
    finally:
        assert d.stop()[0] == 0
    assert runs[True][1] == runs[False][1]
    for step, (a, b) in enumerate(zip(runs[True][0], runs[False][0], strict=True)):
        assert torch.equal(a, b), f"step {step} differs from the eager streaming step"


class FakeStream:
    def wait_stream(self, other: "FakeStream") -> None:
        pass


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: records when captures begin and end."""
    log: list[tuple[str, int, object]] = []
    refuse_at: int | None = None  # the capture_begin (counted from 0) that raises, if any

    def __init__(self) -> None:
        self.id = sum(1 for event in self.log if event[0] == "begin")

    def capture_begin(self, pool: object = None) -> None:
        if self.id == self.refuse_at:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        self.log.append(("begin", self.id, pool))

    def capture_end(self) -> None:
        self.log.append(("end", self.id, None))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the faked capture's kernels compute over other experts
@pytest.mark.parametrize("refuse_at", [None, 2], ids=["captured", "refused"])
def test_capture_splits_the_pass_at_every_stop(refuse_at: int | None, fixture_packs, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SegmentedDecode's capture, its CUDA calls faked on the CPU (the kernels run instead of
    being recorded, over slots that hold other experts by then: their results are not looked
    at, and the KV cache is not decoded further): one graph per segment, each begun in the
    shared pool and ended once, in order, with no host step inside; the cache's length and the
    seams put back. A capture refused midway ends the open graph and leaves `failed` set."""
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_for(pack, tmp_path)
    FakeGraph.log, FakeGraph.refuse_at = [], refuse_at
    pool = object()
    for name, fake in {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
                       "graph_pool_handle": lambda: pool, "current_stream": lambda device=None: FakeStream(),
                       "Stream": lambda device=None: FakeStream(), "stream": lambda s: contextlib.nullcontext(),
                       "CUDAGraph": FakeGraph}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    try:
        with kernels_on_cpu():
            engine = streamed(pack, d.endpoint, prefetch=True, graphs=True)
            try:
                cache = engine.new_sequence()
                engine.forward(PROMPT, cache)
                engine.forward([3], cache)  # the eager pass that makes the stops
                segmented = engine._graphs.get(0)
                n_stops, length = len(segmented.stops), cache.length
                host_steps = []
                monkeypatch.setattr(segmented, "_between", lambda stop: host_steps.append(stop))
                with torch.inference_mode():  # as Engine.forward runs it
                    segmented._capture()
                assert host_steps == [] and cache.length == length
                assert engine.model.moe.boundary is None and cache.kv.step_positions is None
                if refuse_at is None:
                    assert segmented.failed is None and segmented.logits is not None
                    assert len(segmented.graphs) == n_stops + 1
                    assert FakeGraph.log == [event for i in range(n_stops + 1)
                                             for event in (("begin", i, pool), ("end", i, None))]
                else:
                    assert isinstance(segmented.failed, RuntimeError) and segmented.graphs == []
                    assert FakeGraph.log == [event for i in range(refuse_at)
                                             for event in (("begin", i, pool), ("end", i, None))]
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
