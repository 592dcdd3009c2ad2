"""Decode steps over the expert cache replayed as CUDA graphs split at the MoE layers
(engine.SegmentedDecode; skipped without a GPU, run on the device machine), against a real
expertd with a cache of the minimum size (misses and evictions at every layer):

- bit for bit the logits, greedy tokens and cache counters of the eager streaming step
  (`graphs` off), with prefetch on and off, across a re-capture when the KV cache outgrows its
  reservation and a second request in the same arena slot; and the resident run's logits;
- a replayed step syncs the host once per MoE layer (CUDA's sync debug mode counts them), where
  the eager step syncs more often;
- a capture that fails leaves the engine stepping eagerly, with the same bits.
tests/worker/test_segmented_decode.py runs the same stops and host steps eagerly on the CPU."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.packtools.layout import Manifest
from expertpack.worker.engine.engine import Engine, SegmentedDecode
from expertpack.worker.engine.graphs import TableDecode
from expertpack.worker.experts.expert_cache import slot_bytes

from ..conftest import FIXTURES, Daemon, start_daemon
from ..helpers.engine import minimal_cache_bytes

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

MODELS = {  # one of each expert activation the fixtures hold; a dense leading layer; a latent MoE with KDA states;
    "qwen3moe-a": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",
    "gptoss-a": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
    "deepseek3-a": "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf",
    "k3-tiny": "flagship/kimi-k3/k3-tiny.Q2_K.gguf",
    "dsv4-tiny": "flagship/deepseek4/dsv4-tiny.Q2_K.gguf",  # hash layers: experts looked up from the token
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("segmented-packs")
    out = {}
    for name, src in MODELS.items():
        build_pack(FIXTURES / src, root / name, BuildOptions(progress=False, safety_margin_bytes=0))
        out[name] = root / name
    return out


def daemon_on(pack: Path, tmp: Path) -> Daemon:
    d = start_daemon(pack, tmp, "--client-slots", "8")
    d.wait_for("READY=1")
    return d


def streamed(pack: Path, d: Daemon, prefetch: bool = True, graphs: bool = True) -> Engine:
    engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=prefetch)
    engine.graphs = graphs
    return engine


def decode(engine: Engine, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The logits of n greedy decode steps after the prompt [n, n_vocab], and their tokens."""
    cache = engine.new_sequence()
    logits = engine.forward(prompt, cache, last=True)
    steps, tokens = [], []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = engine.forward(tokens[-1:], cache)
        steps.append(logits[-1])
    return torch.stack(steps).cpu(), tokens


def counters(engine: Engine) -> tuple[int, ...]:
    c = engine.expert_cache.counters
    return c.hits, c.misses, c.evictions, c.h2d_bytes


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_segmented_graphs_equal_the_eager_streaming_step(model: str, prefetch: bool, packs, tmp_path: Path) -> None:
    pack = packs[model]
    rng = random.Random(0)
    resident = Engine.load(pack, "cuda", resident_experts=True)
    n_vocab = resident.forward([1], resident.new_sequence()).shape[-1]
    prompt = rng.choices(range(n_vocab), k=505)  # decoding crosses 512 positions: one re-capture
    second = rng.choices(range(n_vocab), k=600)  # a second request in the same slot's 1024 positions
    want_resident = decode(resident, prompt, 12)
    del resident
    torch.cuda.empty_cache()
    d = daemon_on(pack, tmp_path)
    try:
        runs = {}
        for graphs in (False, True):
            engine = streamed(pack, d, prefetch, graphs)
            try:
                first = decode(engine, prompt, 12)
                if graphs:
                    segmented = engine._graphs.get(0)
                    assert isinstance(segmented, SegmentedDecode) and segmented.buffers[0][1] == 1024  # its capacity
                    assert len(segmented.graphs) == len(segmented.stops) + 1 == len(engine.expert_cache.served) + 1
                    stateful = bool(segmented.inputs.caches[0].state)
                    assert stateful == (model in ("k3-tiny", "dsv4-tiny"))
                later = decode(engine, second, 6)
                if graphs:  # states (KDA's, DeepSeek-V4's compressors) cleared in place
                    assert engine._graphs.get(0) is segmented, "the second request was captured again"
                runs[graphs] = first, later, counters(engine)
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    (got, got_later, got_counters), (want, want_later, want_counters) = runs[True], runs[False]
    assert got[1] == want[1] and got_later[1] == want_later[1]
    for name, a, b in (("first request", got[0], want[0]), ("second request", got_later[0], want_later[0]),
                       ("first request vs resident", got[0], want_resident[0])):
        assert torch.equal(a, b), f"{model}: {name}: max |diff| {(a - b).abs().max().item():.2e}"
    assert got_counters == want_counters  # the same hits, misses and evictions: the same host steps


def syncs_of(engine: Engine, token: int, cache) -> list[str]:
    """The host syncs of one decode step, as CUDA's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.forward([token], cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def test_a_replayed_step_syncs_once_per_moe_layer(packs, tmp_path: Path) -> None:
    pack = packs["qwen3moe-a"]
    d = daemon_on(pack, tmp_path)
    try:
        counts = {}
        for graphs in (False, True):
            engine = streamed(pack, d, graphs=graphs)
            try:
                n_moe = len(engine.expert_cache.served)
                cache = engine.new_sequence()
                engine.forward([1, 5, 9, 200], cache)
                engine.forward([3], cache)  # eagerly through the segments, then captured
                counts[graphs] = [len(syncs_of(engine, t, cache)) for t in (7, 11, 13)]
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    print(f"host syncs per step over {n_moe} MoE layers: eager {counts[False]}, segmented graphs {counts[True]}")
    assert all(c > n_moe for c in counts[False]), "the sync count misses the eager step's syncs"
    assert counts[True] == [n_moe] * 3


def test_a_failed_capture_steps_eagerly_with_the_same_bits(packs, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pack = packs["qwen3moe-a"]
    prompt = list(range(5, 25))
    d = daemon_on(pack, tmp_path)
    try:
        eager = streamed(pack, d, graphs=False)
        try:
            want = decode(eager, prompt, 6)
        finally:
            eager.close()

        def refuse(*args, **kwargs):
            raise RuntimeError("operation not permitted when stream is capturing (injected)")

        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
        engine = streamed(pack, d)
        try:
            got = decode(engine, prompt, 6)
            assert engine._graphs.get(0) is None and not engine.graphs
        finally:
            engine.close()
    finally:
        assert d.stop()[0] == 0
    assert got[1] == want[1] and torch.equal(got[0], want[0])


@pytest.mark.parametrize("model", ["qwen3moe-a", "gptoss-a", "deepseek3-a"])
def test_steps_from_the_table_equal_the_eager_streaming_step(model: str, packs, tmp_path: Path) -> None:
    """A cache that holds every expert: once a step missed nothing, the next runs as one graph over
    the cache's device table (TableDecode), syncing the host once, and not at all once fill() read
    every expert in; the logits, tokens and counters are the eager streaming step's (prefetch off:
    a table step sends nothing ahead). A minimal
    cache, every step tried from the table first: no pass that found an expert absent is kept."""
    pack = packs[model]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert * slot_bytes(manifest)
    prompt = random.Random(1).choices(range(100), k=9)
    d = daemon_on(pack, tmp_path)
    try:
        for cache_bytes, always_try in ((every_expert, False), (minimal_cache_bytes(pack), True)):
            runs, kept = {}, []
            for graphs in (False, True):
                engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=cache_bytes, prefetch=False)
                engine.graphs = graphs
                real_step = TableDecode.step

                def counted(self: TableDecode, token: int) -> torch.Tensor | None:
                    logits = real_step(self, token)
                    kept.append(logits is not None)
                    return logits
                try:
                    with pytest.MonkeyPatch.context() as m:
                        m.setattr(TableDecode, "step", counted)
                        if always_try:
                            m.setattr(Engine, "_found_all", property(lambda self: True, lambda self, v: None))
                        runs[graphs] = decode(engine, prompt, 10), counters(engine)
                        if graphs and not always_try:  # the same tokens again: every expert is in the cache
                            tokens = runs[True][0][1]
                            sequence = engine.new_sequence()
                            engine.forward(prompt, sequence, last=True)
                            engine.forward(tokens[:1], sequence)
                            syncs = [w for w in syncs_of(engine, tokens[1], sequence) if "called a synchronizing" in w]
                            assert kept[-2:] == [True, True] and len(syncs) <= 1, (kept, syncs)  # the record's
                            engine.expert_cache.fill()  # every expert now: no step can miss, none looks back
                            assert engine.expert_cache.holds_every_expert
                            engine.forward(tokens[1:2], sequence)
                            syncs = [w for w in syncs_of(engine, tokens[2], sequence) if "called a synchronizing" in w]
                            assert kept[-1] and not syncs, (kept, syncs)
                finally:
                    engine.close()
            (got, got_counters), (want, want_counters) = runs[True], runs[False]
            assert got[1] == want[1]
            assert torch.equal(got[0], want[0]), f"{model}: max |diff| {(got[0] - want[0]).abs().max().item():.2e}"
            assert got_counters == want_counters
            assert (any(kept) if not always_try else not all(kept)), kept
    finally:
        assert d.stop()[0] == 0


@pytest.mark.parametrize("model", ["qwen3moe-a", "gptoss-a", "deepseek3-a"])
def test_table_steps_over_kept_ram_tier_blocks_equal_the_eager_step(model: str, packs, tmp_path: Path) -> None:
    """Issue 34 on the GPU: a cache of part of the experts over a RAM tier that holds the pack,
    filled at start, keeps the rest in the tier (protocol v8). Every step then finds its experts in
    VRAM or kept: with graphs, it runs as one graph whose lookup copies the kept blocks into VRAM on
    the GPU; eagerly, the expert kernels read them where they lie, over PCIe; with the lookahead
    on, the graph also copies the next layer's guessed kept blocks ahead on a side stream and
    reads the right guesses from there. expertd is asked for nothing after the fill, and all give
    the same logits, bit for bit."""
    pack = packs[model]
    manifest = Manifest.load(pack)
    every = len(manifest.layers) * manifest.model.n_expert
    keeps = every - max(8, min(256, every // 2))  # expertd's keep share here: the tier less the hold share
    slots = every - (keeps - max(1, keeps // 16)) + 1  # what the cache must hold beside the blocks it keeps
    prompt = random.Random(2).choices(range(100), k=9)
    d = start_daemon(pack, tmp_path, "--client-slots", "8", "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    runs, ran, ahead = {}, [], {}
    try:
        for graphs, prefetch in ((False, False), (True, False), (True, True)):
            engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=slots * slot_bytes(manifest),
                                 prefetch=prefetch)
            engine.graphs = graphs
            real_step = TableDecode.step

            def counted(self: TableDecode, token: int) -> torch.Tensor | None:
                logits = real_step(self, token)
                at = self.staged[1] if self.graph is not None else self.record[1].cpu()
                ran.append((logits is not None, bool(((at < 0) | (at >= self.source.slots_end)).any())))
                return logits
            try:
                cache = engine.expert_cache
                cache.fill()
                assert len(cache.policy.slot_of) + len(cache.kept) >= every and len(cache.kept) > 0
                fetches = cache.fetches
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(TableDecode, "step", counted)
                    runs[graphs, prefetch] = decode(engine, prompt, 10)
                assert cache.fetches == fetches  # nothing asked of expertd after the fill
                ahead[prefetch] = cache.read_ahead()
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    want, want_tokens = runs[False, False]
    assert ran and all(kept for kept, _ in ran) and any(tier for _, tier in ran), ran
    assert ahead[False] == {"kept_pairs": 0, "read_ahead": 0, "copied_ahead": 0}, ahead
    copies = ahead[True]  # the fill leaves the first layer's experts kept: these two-layer models' guessed
    assert copies["read_ahead"] <= min(copies["kept_pairs"], copies["copied_ahead"]), copies  # one has few if any
    for (graphs, prefetch), (got, got_tokens) in runs.items():
        assert got_tokens == want_tokens, (graphs, prefetch)
        assert torch.equal(got, want), f"{model} {graphs=} {prefetch=}: max |diff| {(got - want).abs().max().item():.2e}"


def test_captured_steps_copy_guessed_kept_blocks_ahead_with_the_same_bits(tiny_pack: Path, tmp_path: Path) -> None:
    """The copies ahead in the captured graph (the side stream, its events, the ahead slots), on a
    pack of 4 MoE layers (16 experts top-4) read once at start with half its experts then kept in
    the tier: most kept pairs of the guessed layers are read from their ahead slots, and the logits
    and tokens are the eager steps' bit for bit (tests/worker/test_table_decode.py: the same on the CPU)."""
    manifest = Manifest.load(tiny_pack)
    every = len(manifest.layers) * manifest.model.n_expert
    cache_bytes = (every - every // 2 + 4) * slot_bytes(manifest)  # beside the keeps expertd allows
    prompt = random.Random(3).choices(range(100), k=9)
    d = start_daemon(tiny_pack, tmp_path, "--client-slots", "8", "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    runs = {}
    try:
        for graphs, prefetch in ((False, False), (True, True)):
            engine = Engine.load(tiny_pack, "cuda", daemon=d.endpoint, cache_bytes=cache_bytes, prefetch=prefetch)
            engine.graphs = graphs
            try:
                engine.expert_cache.fill()
                runs[graphs] = decode(engine, prompt, 12)
                copies = engine.expert_cache.read_ahead()
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    assert 0 < copies["read_ahead"] <= min(copies["kept_pairs"], copies["copied_ahead"]), copies
    (got, got_tokens), (want, want_tokens) = runs[True], runs[False]
    assert got_tokens == want_tokens
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.2e}"


@pytest.mark.parametrize("model", ["qwen3moe-a", "gptoss-a", "deepseek3-a"])
def test_prompts_from_the_table_equal_the_eager_prompt(model: str, packs, tmp_path: Path) -> None:
    """Issue 35 on the GPU: a cache that holds every expert in VRAM, filled at start and warmed up
    as expert-worker does (Engine.warm_up: a graph per short prompt length over the device table),
    runs prompts of 9 and 33 tokens as those graphs and one of 70 as an eager pass over the table,
    and gives the logits and greedy tokens of the same prompts run with the host's lookups (table
    steps off), bit for bit, asking expertd for nothing after the fill."""
    pack = packs[model]
    manifest = Manifest.load(pack)
    every = len(manifest.layers) * manifest.model.n_expert * slot_bytes(manifest)
    rng = random.Random(3)
    prompts = [rng.choices(range(100), k=n) for n in (9, 33, 70)]
    d = daemon_on(pack, tmp_path)
    runs, ran = {}, []
    try:
        for table in (False, True):
            engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=every, prefetch=False)
            engine.table_steps = table
            real_step = TableDecode.step

            def counted(self: TableDecode, tokens: int | list[int]) -> torch.Tensor | None:
                logits = real_step(self, tokens)
                if self.tokens > 1:
                    ran.append((self.tokens, self.graph is not None, logits is not None))
                return logits
            try:
                cache = engine.expert_cache
                cache.fill()
                assert cache.holds_every_expert
                engine.warm_up(1)
                fetches = cache.fetches
                ran.clear()
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(TableDecode, "step", counted)
                    runs[table] = [decode(engine, prompt, 3) for prompt in prompts]
                assert cache.fetches == fetches
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    assert ran == [(9, True, True), (33, True, True), (70, False, True)], ran
    for (got, got_tokens), (want, want_tokens) in zip(runs[True], runs[False]):
        assert got_tokens == want_tokens
        assert torch.equal(got, want), f"{model}: max |diff| {(got - want).abs().max().item():.2e}"
