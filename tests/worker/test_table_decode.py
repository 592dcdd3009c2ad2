"""A decode step over the expert cache as one pass that looks its experts up in the cache's device
table (engine.TableDecode), on the CPU: the pass runs eagerly under Triton's interpreter with the
lookups that the CUDA graph replays (tests/gpu replays the graph itself). Against a real expertd:

- a cache that holds every expert: once the step before missed nothing, steps run from the table,
  and give the eager streaming step's logits, tokens and cache counters (hits, misses, evictions)
  bit for bit;
- a cache of the minimum size, every step tried from the table first: the pass that finds an
  expert absent is never kept (the token runs again in segments, which fetch it), so logits,
  tokens and counters are still the eager step's;
- a cache of half the experts over a RAM tier that holds them all: the evicted ones stay kept in
  the tier (protocol v8), table steps copy them in on the device and keep their logits, which are
  the eager step's (reading them in place) bit for bit, and expertd is asked nothing more; with
  the lookahead on, the guessed ones copied ahead of their layer, still bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertpack.packtools.layout import Manifest
from expertpack.worker.engine.engine import STATIC_PROMPT_MAX_TOKENS, Engine
from expertpack.worker.engine.graphs import SegmentedDecode, TableDecode
from expertpack.worker.experts.expert_cache import ExpertCache, slot_bytes
from expertpack.worker.nn.backend import kernels_on_cpu

from ..helpers.engine import assert_same, daemon_for, greedy_run, minimal_cache_bytes

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu replays the graph; "
                                                                  "the interpreter is for CPUs"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.usefixtures("interpreter_tiles", "short_reservations")]
PACK = "qwen3moe-a.Q4_K_M"
PROMPT = [1, 5, 9]
N_STEPS = 4


def counters(engine: Engine) -> tuple[int, ...]:
    c = engine.expert_cache.counters
    return c.hits, c.misses, c.evictions, c.h2d_bytes, c.steps


def run(pack: Path, endpoint: str, cache_bytes: int, table_steps: bool, always_try: bool = False,
        n_steps: int = N_STEPS, fill: bool = False, prefetch: bool = False
        ) -> tuple[tuple[list[torch.Tensor], list[int]], tuple[int, ...], dict]:
    """Greedy decode through expertd, prefetch off unless asked (with it, table steps copy kept
    blocks ahead), every expert read first with `fill`; the logits and tokens, the cache's
    counters, and how the steps ran (table steps kept and dropped, kept ones that read an expert
    from a kept RAM-tier block, ones whose record was not looked at before the next step, and
    what was copied ahead)."""
    ran = {"kept": 0, "dropped": 0, "from_tier": 0, "unread": 0}
    real_step, real_found = TableDecode.step, ExpertCache.found_on_device

    def unread(self: ExpertCache, record: torch.Tensor) -> None:
        ran["unread"] += 1
        real_found(self, record)

    def counted(self: TableDecode, token: int) -> torch.Tensor | None:
        logits = real_step(self, token)
        ran["kept" if logits is not None else "dropped"] += 1
        at = self.record[1]
        ran["from_tier"] += logits is not None and bool(((at != -1) & ((at < 0) | (at >= self.source.slots_end))).any())
        return logits

    engine = Engine.load(pack, daemon=endpoint, cache_bytes=cache_bytes, prefetch=prefetch)
    engine.table_steps = table_steps
    try:
        if fill:
            engine.expert_cache.fill()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(TableDecode, "step", counted)
            m.setattr(ExpertCache, "found_on_device", unread)
            if always_try:  # every step tries the table first, whatever the step before found
                real = Engine._static_step

                def eager_to_try(self: Engine, *args, **kwargs):
                    self._found_all = True
                    return real(self, *args, **kwargs)
                m.setattr(Engine, "_static_step", eager_to_try)
            result = greedy_run(engine, PROMPT, n_steps)
        ran["kept_hits"] = engine.expert_cache.counters.kept_hits
        ran["fetches"] = engine.expert_cache.fetches
        ran["ahead"] = engine.expert_cache.read_ahead()
        return result, counters(engine), ran
    finally:
        engine.close()


@pytest.mark.parametrize("fill", [False, True], ids=["fetched-by-steps", "filled"])
def test_a_cache_holding_every_expert_steps_from_the_table_with_the_same_bits(fill: bool, fixture_packs,
                                                                              tmp_path: Path) -> None:
    """A cache with a slot for every expert: once the step before missed nothing, steps run from the
    table. While some experts were never read, each step's record is looked at before its logits
    are kept; once fill() read every expert in (as expert-worker starts) no step can find one
    absent, so none stops for its record (counted when the counters are next read). Logits,
    tokens and counters are the eager step's either way."""
    pack = fixture_packs[PACK][1]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert * slot_bytes(manifest)
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want, want_counters, _ = run(pack, d.endpoint, every_expert, table_steps=False, fill=fill)
            got, got_counters, ran = run(pack, d.endpoint, every_expert, table_steps=True, fill=fill)
    finally:
        assert d.stop()[0] == 0
    if fill:
        assert ran["unread"] == ran["kept"] == N_STEPS - 1, ran  # the first step runs in segments (none found yet)
    else:
        assert ran["kept"] >= 1 and ran["unread"] == 0, ran  # the later steps find what their predecessors fetched
    assert_same(got, want, "steps from the table")
    assert got_counters == want_counters  # the touches owed by table steps were paid, in order


def test_a_step_that_finds_an_expert_absent_is_never_kept(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[PACK][1]
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want, want_counters, _ = run(pack, d.endpoint, minimal_cache_bytes(pack), table_steps=False)
            got, got_counters, ran = run(pack, d.endpoint, minimal_cache_bytes(pack), table_steps=True,
                                         always_try=True)
    finally:
        assert d.stop()[0] == 0
    assert ran["dropped"] >= 1, ran  # a minimal cache evicts at every layer: a later layer misses
    assert ran["unread"] == 0, ran  # every step's record is looked at before its logits are kept
    assert_same(got, want, "steps tried from the table")
    assert got_counters == want_counters


def test_table_steps_read_kept_ram_tier_blocks_with_the_same_bits(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[PACK][1]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert
    # expertd lets the worker keep its tier (the whole pack here) less its hold share, half of it: the cache holds the rest
    cache_bytes = (every_expert - every_expert // 2) * slot_bytes(manifest)
    d = daemon_for(pack, tmp_path, "--ram-cache-gib", "1")
    try:
        with kernels_on_cpu():
            want, want_counters, eager = run(pack, d.endpoint, cache_bytes, table_steps=False, n_steps=8)
            got, _, ran = run(pack, d.endpoint, cache_bytes, table_steps=True, n_steps=8)
    finally:
        assert d.stop()[0] == 0
    assert want_counters[2] > 0 and eager["kept_hits"] > 0, (want_counters, eager)  # evicted, then read from the tier
    assert ran["from_tier"] >= 1, ran  # (a step choosing an expert never fetched before is dropped)
    assert ran["fetches"] <= eager["fetches"]
    assert ran["ahead"] == {"kept_pairs": 0, "read_ahead": 0, "copied_ahead": 0}, ran  # no lookahead, no copies
    assert_same(got, want, "steps from the table, kept blocks copied in on the device")


def test_table_steps_copy_guessed_kept_blocks_ahead_with_the_same_bits(tiny_pack: Path, tmp_path: Path) -> None:
    """With the lookahead on, a table step copies the next layer's guessed kept blocks ahead of it
    (4 MoE layers, 16 experts top-4: three layers a step are guessed; every expert read once first,
    as expert-worker starts, half of them then kept in the tier): the right guesses are read
    from their ahead slots, the others copied in as before, and the logits and tokens are the eager
    steps' bit for bit."""
    manifest = Manifest.load(tiny_pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert
    # the keeps expertd allows (half the experts) leave a sixteenth free: the slots hold a few more than the rest
    cache_bytes = (every_expert - every_expert // 2 + 4) * slot_bytes(manifest)
    d = daemon_for(tiny_pack, tmp_path, "--ram-cache-gib", "1")
    try:
        with kernels_on_cpu():
            want, _, _ = run(tiny_pack, d.endpoint, cache_bytes, table_steps=False, n_steps=8, fill=True)
            got, _, ran = run(tiny_pack, d.endpoint, cache_bytes, table_steps=True, n_steps=8, prefetch=True,
                              fill=True)
    finally:
        assert d.stop()[0] == 0
    copies = ran["ahead"]
    assert ran["from_tier"] >= 1, ran
    assert 0 < copies["read_ahead"] <= min(copies["kept_pairs"], copies["copied_ahead"]), (ran, copies)
    assert_same(got, want, "steps from the table, kept blocks copied ahead")


def run_turns(pack: Path, endpoint: str, cache_bytes: int, table_steps: bool, try_prompts: bool = False
              ) -> tuple[tuple[list[torch.Tensor], list[int]], tuple[int, ...], dict[str, int]]:
    """A conversation's turns through expertd, prefetch off: a prompt and greedy steps, then a
    second prompt continuing the sequence (static shapes, as a chat's next turn), then a prompt
    longer than STATIC_PROMPT_MAX_TOKENS in a sequence of its own (eager shapes). The logits and
    tokens, the counters, and how many prompts a table pass kept and dropped. `try_prompts`: every
    prompt is tried from the table, whatever the cache holds."""
    ran = {"kept": 0, "dropped": 0}
    real_step = TableDecode.step

    def counted(self: TableDecode, tokens: int | list[int]) -> torch.Tensor | None:
        logits = real_step(self, tokens)
        if self.tokens > 1:
            ran["kept" if logits is not None else "dropped"] += 1
            # A prompt's record is read back, not left in a ring of records as long as the prompt.
            assert not any(ring.count for ring in self.source._rings.values() if ring.records.shape[-1] > k)
        return logits

    k = Manifest.load(pack).model.n_expert_used
    engine = Engine.load(pack, daemon=endpoint, cache_bytes=cache_bytes, prefetch=False)
    engine.table_steps = table_steps
    try:
        engine.expert_cache.fill()  # as expert-worker starts: where the slots hold every expert, all read once
        with pytest.MonkeyPatch.context() as m:
            m.setattr(TableDecode, "step", counted)
            if try_prompts:  # not by saying the cache holds every expert: its steps would then not look
                m.setattr(Engine, "_prompt_from_table", lambda self, cache: True)
            seq = engine.new_sequence()
            logits, tokens = greedy_run(engine, PROMPT, N_STEPS, seq)
            more, more_tokens = greedy_run(engine, [tokens[-1], 7, 3, 11, 2], 2, seq)
            long_prompt = [(5 * i + 1) % 50 for i in range(STATIC_PROMPT_MAX_TOKENS + 6)]
            last, last_tokens = greedy_run(engine, long_prompt, 1)
        return (logits + more + last, tokens + more_tokens + last_tokens), counters(engine), ran
    finally:
        engine.close()


def test_prompts_over_a_cache_holding_every_expert_run_from_the_table_with_the_same_bits(
        fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[PACK][1]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert * slot_bytes(manifest)
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want, want_counters, _ = run_turns(pack, d.endpoint, every_expert, table_steps=False)
            got, got_counters, ran = run_turns(pack, d.endpoint, every_expert, table_steps=True)
    finally:
        assert d.stop()[0] == 0
    assert ran == {"kept": 2, "dropped": 0}  # after the first, which runs before any step has found its experts
    assert_same(got, want, "prompts from the table")
    assert got_counters == want_counters


def test_a_prompt_that_finds_an_expert_outside_the_vram_slots_is_never_kept(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[PACK][1]
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want, want_counters, _ = run_turns(pack, d.endpoint, minimal_cache_bytes(pack), table_steps=False)
            got, got_counters, ran = run_turns(pack, d.endpoint, minimal_cache_bytes(pack), table_steps=True,
                                               try_prompts=True)
    finally:
        assert d.stop()[0] == 0
    assert ran["dropped"] >= 2, ran  # a minimal cache holds one token's k: a prompt's picks are not all there
    assert_same(got, want, "prompts tried from the table")
    assert got_counters == want_counters


BATCH = {"c": (0, 1), "e": (0, 1)}  # tests/helpers/batched.py's sequences: two rows, one batched step


def run_batch(pack: Path, endpoint: str, cache_bytes: int, graphs: bool
              ) -> tuple[dict[str, tuple[list[int], list[torch.Tensor]]], tuple[int, ...], dict[str, int]]:
    """Two sequences' prompts, then a batched step of both through expertd (prefetch off): with
    `graphs` as expert-worker runs it (tried from the table first, then in segments), else the
    eager static step. Each row's tokens and logits, the counters, and how many batched table
    passes were kept and dropped and how many steps ran in segments."""
    from ..helpers.batched import batched

    ran = {"kept": 0, "dropped": 0, "segmented": 0}
    real_step, real_segments, real_batch = TableDecode.step, SegmentedDecode.step, Engine._static_batch

    def counted(self: TableDecode, tokens: int | list[int]) -> torch.Tensor | None:
        logits = real_step(self, tokens)
        if len(self.caches) > 1:
            ran["kept" if logits is not None else "dropped"] += 1
        return logits

    def in_segments(self: SegmentedDecode, tokens: int | list[int]) -> torch.Tensor:
        ran["segmented"] += len(self.inputs.caches) > 1
        return real_segments(self, tokens)

    def try_table(self: Engine, *args, **kwargs) -> torch.Tensor:
        self._found_all = True
        return real_batch(self, *args, **kwargs)

    engine = Engine.load(pack, daemon=endpoint, cache_bytes=cache_bytes, prefetch=False)
    engine.table_steps = engine.graphs = graphs
    try:
        engine.expert_cache.fill()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(TableDecode, "step", counted)
            m.setattr(SegmentedDecode, "step", in_segments)
            m.setattr(Engine, "_static_batch", try_table)
            got = batched(engine, BATCH)
        return got, counters(engine), ran
    finally:
        engine.close()


@pytest.mark.parametrize("cache", ["every-expert", "half", "minimal"])
def test_batched_steps_from_the_table_or_in_segments_keep_the_eager_bits(fixture_packs, tmp_path: Path,
                                                                         cache: str) -> None:
    """A batched step (continuous batching's) over the cache's device table: with every expert
    in VRAM the pass is kept; with half of them the rows' picks are seldom all there and the
    step runs in segments, the host fetching each layer's misses for both rows at once; with a
    minimal cache (one token's k) the rows' picks do not fit one wave and it runs eagerly. Each
    row's logits, its tokens and the cache's counters are the eager batched step's, bit for bit."""
    pack = fixture_packs[PACK][1]
    manifest = Manifest.load(pack)
    n_experts = len(manifest.layers) * manifest.model.n_expert
    cache_bytes = {"every-expert": n_experts * slot_bytes(manifest), "half": n_experts // 2 * slot_bytes(manifest),
                   "minimal": minimal_cache_bytes(pack)}[cache]
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want, want_counters, eager = run_batch(pack, d.endpoint, cache_bytes, graphs=False)
            got, got_counters, ran = run_batch(pack, d.endpoint, cache_bytes, graphs=True)
    finally:
        assert d.stop()[0] == 0
    assert eager == {"kept": 0, "dropped": 0, "segmented": 0}
    if cache == "every-expert":
        assert ran == {"kept": 1, "dropped": 0, "segmented": 0}, ran
    elif cache == "half":
        assert ran == {"kept": 0, "dropped": 1, "segmented": 1}, ran  # (the picks of half the experts)
    else:
        assert ran == {"kept": 0, "dropped": 1, "segmented": 0}, ran
    for name in BATCH:
        assert got[name][0] == want[name][0], f"{name}: greedy tokens differ"
        for g, w in zip(got[name][1], want[name][1], strict=True):
            assert torch.equal(g, w), f"{name}: max |diff| {(g - w).abs().max():.3g}"
    assert got_counters == want_counters
