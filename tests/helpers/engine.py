"""Runs of an Engine for tests to compare bit for bit: greedy runs' logits and tokens, static-shape
decode steps, and an engine through a real expertd into an expert cache of the minimum size
against every expert resident."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TypeVar

import torch

from expertpack.packtools.layout import PACK_FILE, Manifest
from expertpack.worker.engine.arena import Sequence
from expertpack.worker.engine.engine import Engine
from expertpack.worker.experts.expert_cache import slot_bytes
from expertpack.worker.nn.backend import kernels_on_cpu
from expertpack.worker.nn.layers import KVCache

from ..conftest import Daemon, start_daemon


def kernels_for(device: torch.device) -> AbstractContextManager:
    """The kernels on `device`: on the CPU through Triton's interpreter (kernels_on_cpu); on CUDA
    nothing to switch, and switching the interpreter on there would define every kernel module
    first imported inside as interpreted for the rest of the session (a test run alone, or
    selected with -k, then fails in another test's launch)."""
    return kernels_on_cpu() if device.type == "cpu" else nullcontext()


T = TypeVar("T")

N_NEW = 8
PROMPT = [1, 5, 9, 200, 17, 3]  # the split-over-devices tests' (tests/worker/test_multi_device.py, tests/kernels)


def greedy_run(engine: Engine, prompt: list[int], n: int = N_NEW, cache: Sequence | None = None
               ) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of the prompt and of every decode step, and the greedy tokens (in `cache`, or a new one)."""
    cache = cache if cache is not None else engine.new_sequence()
    logits = [engine.forward(prompt, cache)]
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(engine.forward(tokens[-1:], cache))
    return logits, tokens


def assert_same(got: tuple[list[torch.Tensor], list[int]], want: tuple[list[torch.Tensor], list[int]], what: str) -> None:
    assert got[1] == want[1], f"{what}: greedy tokens differ"
    for step, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(g, w), f"{what}: logits of step {step} differ (max |diff| {(g - w).abs().max():.3g})"


def static_steps(engine: Engine, cache: KVCache, feed: list[int]) -> torch.Tensor:
    """Logits [len(feed), V] of one-token steps at a device position, as a captured step runs."""
    position = torch.zeros(1, dtype=torch.int64)
    cache.step_positions = position
    got = []
    try:
        with torch.inference_mode():
            for t in feed:
                position.fill_(cache.length)
                got.append(engine.model.forward(torch.tensor([t]), cache).to(torch.float32))
    finally:
        cache.step_positions = None
    return torch.cat(got)


def minimal_cache_bytes(pack: Path) -> int:
    manifest = Manifest.load(pack)
    return manifest.model.n_expert_used * slot_bytes(manifest)


def daemon_for(pack: Path, tmp: Path, *extra: str) -> Daemon:
    d = start_daemon(pack, tmp, "--stage-slots", "12", "--client-slots", "3", *extra)
    d.wait_for("READY=1")
    return d


def assert_every_key_accounted(cache: dict, daemon: dict) -> None:
    """The keys expertd counted against the cache's counters: every miss asked once, on demand or
    ahead (prefetches their layer did not use were sent too), and the keys the worker asked again
    (a failed or late answer, a lapsed session) once more at most: expertd did not count a first ask
    that reached it on a session it had already ended. Each key it counted was answered (READY) or
    cancelled, but for those dropped with a session it ended, which the worker asked again."""
    once = cache["misses"] - cache["prefetch_used"] + cache["prefetch_issued"]
    assert once <= daemon["keys"] <= once + cache["refetched"], (cache, daemon)
    assert 0 <= daemon["keys"] - daemon["ready"] - daemon["cancelled"] <= cache["refetched"], (cache, daemon)


def resident_and_minimal_cache(pack: Path, tmp: Path, run: Callable[[Engine], T]) -> tuple[T, T]:
    """What `run` gives with every expert resident, then through expertd into a cache of one step
    of one layer, whose steps come in waves and evict at every layer (checked): for a test to
    compare, bit for bit where the kernels keep each pair's sums its own."""
    d = daemon_for(pack, tmp)
    try:
        want = run(Engine.load(pack, resident_experts=True))
        engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            got = run(engine)
            assert engine.expert_cache.counters.misses > engine.expert_cache.n_slots, "no waves or evictions"
        finally:
            engine.close()
    finally:
        assert d.stop()[0] == 0
    return want, got


def assert_served_equals_direct(pack: Path, prompt: list[int], tmp: Path) -> None:
    """The pack through a real expertd and a minimal cache gives the in-process run's logits bit
    for bit, and its greedy tokens (for the architectures' own tests)."""
    d = daemon_for(pack, tmp)
    try:
        direct = Engine.load(pack)
        served = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            want_logits, want_tokens = greedy_run(direct, prompt, 6)
            got_logits, got_tokens = greedy_run(served, prompt, 6)
            assert served.expert_cache.counters.evictions > 0
        finally:
            served.close()
        assert got_tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    finally:
        assert d.stop()[0] == 0


def damage_layer(pack: Path, index: int) -> int:
    """Flips one byte of every expert block of the pack's `index`-th MoE layer, on disk: expertd
    fails each of them CORRUPT. Returns that layer's number."""
    manifest = Manifest.load(pack)
    layer = manifest.layers[index]
    with open(pack / PACK_FILE, "r+b") as f:
        for e in range(manifest.model.n_expert):
            f.seek(layer.block_offset(e) + 7)
            byte = f.read(1)[0]
            f.seek(layer.block_offset(e) + 7)
            f.write(bytes([byte ^ 0x10]))
    return layer.layer
