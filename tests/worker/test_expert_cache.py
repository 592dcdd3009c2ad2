"""The expert cache fed by a real expertd process (CPU: the "VRAM" is host memory, the policy, the
protocol and the copies are the same code as on a GPU):

- exactness: prompts through a cache of the minimum size (one step of one layer, so it evicts at
  every layer and prefill comes in waves) give logits bit for bit equal to every expert resident,
  and the same greedy tokens; the counters agree with the keys the router asked for and with the
  daemon's own counters;
- a cache that holds everything misses each expert once and then only hits;
- over expertd's RAM tier, a minimal cache is bit-exact and a second pass reads nothing from the pack;
- the daemon SIGKILLed in the middle of a fetch: restarted, the worker reconnects and the tokens
  are unchanged; left dead, the request fails with DaemonLost, and a later request, once the
  daemon is back, is exact again;
- refusals at load: a daemon serving another pack, a cache below one step;
- a block corrupt on disk: the request fails with CorruptExpert naming the expert and the pack, and
  the bytes never enter the cache.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from expertpack.client import FingerprintMismatch
from expertpack.packtools.layout import PACK_FILE, ExpertKey, Manifest
from expertpack.worker.engine.engine import Engine
from expertpack.worker.experts.cache_policy import CacheTooSmall
from expertpack.worker.experts.daemon_link import CorruptExpert, DaemonLost
from expertpack.worker.experts.expert_cache import slot_bytes
from expertpack.worker.serve.metrics import ServeCounters, render

from ..conftest import FIXTURES, Daemon
from ..helpers.engine import assert_every_key_accounted, daemon_for, greedy_run, minimal_cache_bytes

MODELS = {  # fixture pack -> model of its reference prompt
    "qwen3moe-a.Q4_K_M": "qwen3moe-a",
    "deepseek3-a.Q4_K_M": "deepseek3-a",  # a dense leading layer, a shared expert, payloads that differ per layer
    "gptoss-a.MXFP4_MOE": "gptoss-a",  # top-4, MXFP4, expert biases
}


def prompts(model: str) -> list[list[int]]:
    """The fixture's prompt, then a second one whose experts partly overlap the first's."""
    first = np.load(FIXTURES / "ref" / model / "prompt_ids.npy").tolist()
    return [first, first[::-1][:12]]


@pytest.fixture(scope="module")
def resident(fixture_packs: dict[str, tuple[Path, Path]]) -> dict[str, Engine]:
    return {name: Engine.load(fixture_packs[name][1], resident_experts=True) for name in MODELS}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_minimal_cache_is_bit_exact_and_counts_what_it_does(name: str, fixture_packs, resident, tmp_path: Path) -> None:
    pack = fixture_packs[name][1]
    d = daemon_for(pack, tmp_path)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        cache = engine.expert_cache
        assert cache.n_slots == Manifest.load(pack).model.n_expert_used
        engine.model.moe.routing_log = {}
        for prompt in prompts(MODELS[name]):
            want_logits, want_tokens = greedy_run(resident[name], prompt)
            got_logits, got_tokens = greedy_run(engine, prompt)
            assert got_tokens == want_tokens
            for step, (got, want) in enumerate(zip(got_logits, want_logits)):
                assert torch.equal(got, want), f"{name}: logits of step {step} differ from the resident run"

        unique_per_call = [len(set(ids.flatten().tolist())) for calls in engine.model.moe.routing_log.values()
                           for ids in calls]
        cache.link.settle()  # expertd has handled the cancels of stale prefetches
        stats = cache.stats()
        c, daemon = stats["cache"], stats["daemon"]
        assert c["hits"] + c["misses"] == sum(unique_per_call)
        assert c["steps"] == sum(math.ceil(u / cache.n_slots) for u in unique_per_call)  # waves of n_slots
        assert c["misses"] > 0
        assert c["evictions"] == c["misses"] - cache.n_slots  # full after the first wave, then every miss evicts
        # each miss asked once, on demand or ahead (prefetch, on by default); stale prefetches were cancelled
        assert_every_key_accounted(c, daemon)
        assert daemon["failed"] == daemon["cancelled"]
        payloads = [l.payload_bytes for l in Manifest.load(pack).layers]
        assert c["misses"] * min(payloads) <= c["h2d_bytes"] <= min(c["misses"] * max(payloads),
                                                                     daemon["pack_read_bytes"])
        assert c["resident_bytes"] == cache.n_slots * cache.slot_bytes and c["reconnects"] == 0
        assert c["staging_pinned"] is False  # pinning is for a GPU; tests/gpu checks it there
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_a_cache_that_holds_everything_misses_each_expert_once(fixture_packs, resident, tmp_path: Path) -> None:
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    manifest = Manifest.load(pack)
    d = daemon_for(pack, tmp_path)
    everything = len(manifest.layers) * manifest.model.n_expert * slot_bytes(manifest)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=everything)
    try:
        cache = engine.expert_cache
        engine.model.moe.routing_log = {}
        prompt = prompts(MODELS[name])[0]
        first_logits, _ = greedy_run(engine, prompt)
        selected = {ExpertKey(layer, e) for layer, calls in engine.model.moe.routing_log.items()
                    for ids in calls for e in ids.flatten().tolist()}
        first = cache.counters.snapshot()
        assert first["misses"] == len(selected) and first["evictions"] == 0
        assert cache.resident_bytes == len(selected) * cache.slot_bytes

        second_logits, _ = greedy_run(engine, prompt)  # the same request again: all hits
        again = cache.counters.since(first)
        assert again["misses"] == 0 and again["h2d_bytes"] == 0 and again["hits"] == first["hits"] + first["misses"]
        assert all(torch.equal(a, b) for a, b in zip(first_logits, second_logits))
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_a_minimal_cache_over_the_ram_tier_is_bit_exact_and_reads_each_expert_once(
        fixture_packs, resident, tmp_path: Path) -> None:
    """The worker copies from RAM tier slots (READY naming a slot outside its lease) as from its
    staging: a cache that evicts at every layer gives the resident run's logits, and the second
    pass over the same prompt reads nothing from the pack, evicted experts coming back from the
    tier blocks the worker keeps; /metrics shows the tier."""
    # Here, not at the top: the rest of this module runs on a machine without prometheus_client.
    from prometheus_client.parser import text_string_to_metric_families

    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    d = daemon_for(pack, tmp_path, "--ram-cache-gib", "1")  # the whole (small) pack fits
    # Without prefetch: every key expertd answers is then a miss of the cache, which the counts below
    # rely on (tests/worker/test_prefetch.py runs prefetch over the RAM tier).
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=False)
    try:
        cache = engine.expert_cache
        prompt = prompts(MODELS[name])[0]
        want_logits, _ = greedy_run(resident[name], prompt)
        for attempt in range(2):
            got_logits, _ = greedy_run(engine, prompt)
            for step, (got, want) in enumerate(zip(got_logits, want_logits)):
                assert torch.equal(got, want), f"pass {attempt}: logits of step {step} differ from the resident run"
            stats = cache.stats()
            if attempt == 0:
                first = stats["daemon"]
        daemon, ram = stats["daemon"], stats["daemon_ram"]
        c = stats["cache"]
        # the cache evicts; the tier keeps them, and the worker keeps its holds on them (v8): the
        # evicted experts come back from their kept blocks without asking expertd
        assert c["misses"] + c["kept_hits"] > 2 * first["ram_misses"] and c["kept_hits"] > 0
        assert 0 < c["kept"] <= c["keep_budget"]
        assert daemon["pack_read_bytes"] == first["pack_read_bytes"] and daemon["ram_misses"] == first["ram_misses"]
        assert daemon["ram_hits"] == c["misses"] - daemon["ram_misses"] > 0
        # unkept holds outlive a step only for copies still in flight, released with the next request:
        # at most a cache's worth beside the kept ones
        assert ram["resident_bytes"] > 0 and ram["held"] <= c["slots"] + c["kept"]
        text = render(ServeCounters(), stats["cache"], daemon, ram)
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["expertpack_daemon_ram_hits_total"] == daemon["ram_hits"]
        assert values["expertpack_daemon_ram_misses_total"] == daemon["ram_misses"]
        assert values["expertpack_daemon_ram_evictions_total"] == 0
        assert values["expertpack_daemon_ram_resident_bytes"] == ram["resident_bytes"]
    finally:
        engine.close()
        assert d.stop()[0] == 0


def kill_during_a_fetch(engine: Engine, daemon: Daemon, on_fetch: int, then=None) -> None:
    """SIGKILLs the daemon once the `on_fetch`-th fetch has handed out its first expert (the rest of
    that request is then in flight or lost); `then` runs next, e.g. to start a new daemon. Later
    fetches go through untouched."""
    link = engine.expert_cache.link
    real_fetch, calls = link.fetch, [0]

    def fetch(keys, on_sent=None):
        calls[0] += 1
        for i, expert in enumerate(real_fetch(keys, on_sent)):
            yield expert
            if calls[0] == on_fetch and i == 0:
                daemon.proc.send_signal(signal.SIGKILL)
                daemon.proc.wait()
                if then is not None:
                    then()

    link.fetch = fetch


def test_daemon_killed_mid_fetch_and_restarted_changes_nothing(fixture_packs, resident, tmp_path: Path) -> None:
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    for sub in ("first", "second"):
        (tmp_path / sub).mkdir()
    first = daemon_for(pack, tmp_path / "first")
    successor: list[Daemon] = []

    def restart_soon() -> None:
        def start() -> None:
            time.sleep(0.5)
            successor.append(daemon_for(pack, tmp_path / "second", "--endpoint", first.endpoint))
        threading.Thread(target=start).start()

    engine = Engine.load(pack, daemon=first.endpoint, cache_bytes=minimal_cache_bytes(pack), daemon_timeout_s=1.0)
    try:
        prompt = prompts(MODELS[name])[0]
        kill_during_a_fetch(engine, first, on_fetch=10, then=restart_soon)
        got_logits, got_tokens = greedy_run(engine, prompt)
        want_logits, want_tokens = greedy_run(resident[name], prompt)
        assert first.proc.returncode == -signal.SIGKILL and successor, "the daemon was not killed mid-generation"
        assert engine.expert_cache.link.reconnects >= 1
        assert got_tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    finally:
        engine.close()
        first.notify.close()
        for d in successor:
            assert d.stop()[0] == 0


def test_a_fill_reads_every_expert_once_where_the_model_fits_vram_and_the_ram_tier(
        fixture_packs, resident, tmp_path: Path) -> None:
    """A cache of half the experts over a RAM tier that holds the pack: fill() reads each expert
    once (no policy touch: it is no step), after which every expert is in a slot or kept in the tier
    and a whole run asks expertd for nothing, with the resident run's bits. Without a tier the
    model does not fit: fill() reads nothing."""
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert
    # expertd lets the worker keep half its tier here, all of it but one block (ExpertCache._keep_target)
    cache_bytes = (every_expert - every_expert // 2 + 1) * slot_bytes(manifest)
    for tier_gib in ("1", "0"):
        (tmp_path / f"tier{tier_gib}").mkdir()
        d = daemon_for(pack, tmp_path / f"tier{tier_gib}", "--ram-cache-gib", tier_gib)
        engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=cache_bytes, prefetch=False)
        try:
            cache = engine.expert_cache
            fetched = cache.fill()
            if tier_gib == "0":
                assert fetched == 0 and cache.counters.misses == 0
                continue
            assert every_expert <= fetched == cache.counters.misses and cache.counters.steps == 0
            assert len(cache.policy.slot_of) + len(cache.kept) >= every_expert
            assert cache.fill() == 0  # nothing absent any more
            before = cache.counters.snapshot()
            prompt = prompts(MODELS[name])[0]
            got_logits, got_tokens = greedy_run(engine, prompt)
            want_logits, want_tokens = greedy_run(resident[name], prompt)
            after = cache.counters.since(before)
            assert after["misses"] == 0 and after["kept_hits"] > 0, after
            assert got_tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
        finally:
            engine.close()
            assert d.stop()[0] == 0


def test_a_kept_block_expertd_finds_altered_is_read_no_more(fixture_packs, tmp_path: Path) -> None:
    """The worker's GPU reads kept RAM-tier blocks in place, past any check of expertd's: when the
    scrub finds one altered in memory (a process of expertd's user wrote the segment), expertd says
    so (CONDEMNED) and the cache, at its next step, points the table away from it and lets it go;
    the expert is then read again from the pack, with the pack's bytes."""
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    manifest = Manifest.load(pack)
    every_expert = len(manifest.layers) * manifest.model.n_expert
    cache_bytes = (every_expert - every_expert // 2 + 1) * slot_bytes(manifest)
    d = daemon_for(pack, tmp_path, "--ram-cache-gib", "1")
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=cache_bytes, prefetch=False)
    try:
        cache = engine.expert_cache
        cache.fill()
        key, expert = next((k, e) for k, e in cache.kept.items() if k not in cache.policy.slot_of)
        w = cache.link.client.welcome
        payload = manifest.layer(key.layer).payload_bytes
        fd = os.open(Path("/dev/shm") / w.shm, os.O_RDWR)  # as expertd's user may
        try:
            with mmap.mmap(fd, w.shm_bytes) as writable:
                writable[expert.slot * w.slot_bytes + payload // 2] ^= 0x10
        finally:
            os.close(fd)
        deadline = time.monotonic() + 60  # a loaded machine slows the scrub's reader threads
        while cache.link.stats()["counters"]["corrupt_blocks"] < 1:
            assert time.monotonic() < deadline, "the scrub did not find the altered block in 60 s"
            time.sleep(0.05)
        cache.check_session()  # what each step does first
        assert key not in cache.kept and int(cache.table[key.layer, key.expert]) == -1
        misses = cache.counters.misses
        (weights,) = cache.load(key.layer, [key.expert]).values()
        start = manifest.layer(key.layer).block_offset(key.expert)
        want = np.fromfile(pack / PACK_FILE, dtype=np.uint8, count=payload, offset=start)
        slot = cache.policy.slot_of[key]
        assert cache.counters.misses == misses + 1 and weights
        assert np.array_equal(cache.memory[slot * cache.slot_bytes:][:payload].numpy(), want)
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_a_worker_stopped_past_the_heartbeat_timeout_mid_copy_reads_those_experts_again(
        fixture_packs, resident, tmp_path: Path) -> None:
    """The worker is stopped (SIGSTOP) between an expert's READY and its copy out of staging, longer
    than expertd's heartbeat timeout: the daemon ends the session and may lease the slot to another
    client, so what the copy read cannot be trusted. Simulated here by aging the client's last
    message past the timeout and spoiling the copied bytes: the cache reads the expert again over a
    new session, and the run keeps the resident run's bits."""
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    d = daemon_for(pack, tmp_path)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=False)
    cache = engine.expert_cache
    real_copy_in, calls = cache._copy_in, [0]

    def copy_in(expert, slot, arrived, release=True):
        calls[0] += 1
        real_copy_in(expert, slot, arrived, release)
        if calls[0] == 5:  # stopped before this copy: the slot held another client's bytes by then
            client = expert.client
            client._last_sent -= client._silence_limit_s + 1
            cache.memory[slot * cache.slot_bytes:(slot + 1) * cache.slot_bytes] = 0xFF

    cache._copy_in = copy_in
    try:
        prompt = prompts(MODELS[name])[0]
        got_logits, got_tokens = greedy_run(engine, prompt)
        want_logits, want_tokens = greedy_run(resident[name], prompt)
        assert calls[0] > 5 and cache.link.reconnects == 1
        stats = cache.stats()
        assert stats["cache"]["refetched"] >= 1  # those experts, asked again
        assert_every_key_accounted(stats["cache"], stats["daemon"])
        assert got_tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_daemon_gone_for_good_fails_the_request_clearly(fixture_packs, resident, tmp_path: Path) -> None:
    name = "qwen3moe-a.Q4_K_M"
    pack = fixture_packs[name][1]
    first = daemon_for(pack, tmp_path)
    engine = Engine.load(pack, daemon=first.endpoint, cache_bytes=minimal_cache_bytes(pack),
                         daemon_timeout_s=0.5, down_timeout_s=2.0)
    try:
        prompt = prompts(MODELS[name])[0]
        kill_during_a_fetch(engine, first, on_fetch=3)
        start = time.monotonic()
        with pytest.raises(DaemonLost, match=r"has not answered for 2 s .* could not be fetched"):
            greedy_run(engine, prompt)
        assert time.monotonic() - start < 10
        first.notify.close()

        (tmp_path / "back").mkdir()
        back = daemon_for(pack, tmp_path / "back", "--endpoint", first.endpoint)  # the daemon returns: the next request is exact
        try:
            got_logits, got_tokens = greedy_run(engine, prompt)
            want_logits, want_tokens = greedy_run(resident[name], prompt)
            assert got_tokens == want_tokens
            assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
        finally:
            engine.close()
            assert back.stop()[0] == 0
    finally:
        engine.close()  # idempotent


def test_a_corrupt_block_fails_the_request_and_is_never_computed(fixture_packs, resident, tmp_path: Path) -> None:
    name = "qwen3moe-a.Q4_K_M"
    pack = tmp_path / "pack"
    shutil.copytree(fixture_packs[name][1], pack)
    manifest = Manifest.load(pack)
    prompt = prompts(MODELS[name])[0]
    resident[name].model.moe.routing_log = {}
    try:
        greedy_run(resident[name], prompt, 0)  # the prompt's routing, from the intact pack
        layer, calls = next(iter(resident[name].model.moe.routing_log.items()))
    finally:
        resident[name].model.moe.routing_log = None
    bad = ExpertKey(layer, int(calls[0][0, 0]))  # the first expert the prompt's first MoE layer selects
    block = manifest.layer(bad.layer)
    with open(pack / PACK_FILE, "r+b") as f:
        at = block.block_offset(bad.expert) + block.payload_bytes // 3
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))

    d = daemon_for(pack, tmp_path)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        with pytest.raises(CorruptExpert) as caught:
            greedy_run(engine, prompt, 1)
        text = str(caught.value)
        assert caught.value.key == bad
        assert f"(layer {bad.layer}, expert {bad.expert}) of pack {manifest.fingerprint[:16]}" in text
        assert "corrupt on disk" in text and str(pack) in text and "nothing was computed" in text
        cache = engine.expert_cache
        assert bad not in cache.policy.slot_of
        assert cache.stats()["daemon"]["corrupt_blocks"] == 1
    finally:
        engine.close()
        code, log = d.stop()
    assert code == 0, log
    assert f"corrupt block: layer {bad.layer} expert {bad.expert} " in log


def test_a_daemon_serving_another_pack_is_refused(fixture_packs, tmp_path: Path) -> None:
    d = daemon_for(fixture_packs["qwen3moe-a.Q2_K"][1], tmp_path)
    try:
        pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
        with pytest.raises(FingerprintMismatch, match="this expertd serves pack"):
            Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    finally:
        assert d.stop()[0] == 0


def test_a_cache_below_one_step_is_refused(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_for(pack, tmp_path)
    try:
        with pytest.raises(CacheTooSmall, match="one layer can select 2"):
            Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack) - 1)
    finally:
        assert d.stop()[0] == 0
