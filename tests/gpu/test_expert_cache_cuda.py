"""The expert cache on CUDA, fed by expertd in its own process (skipped without a GPU; run on the
device machine): logits bit for bit equal to every expert resident on the device with a cache of
the minimum size, also with its experts served from expertd's RAM tier, and with prefetch (its
experts copied in from where they waited, nothing left held after); the daemon's staging registered
with CUDA (pinned, so copies are DMA); and the
copies overlapping the reads: launched without waiting, finished while the same request's later
experts are still being read. The overlap is shown on Qwen3-30B-A3B-sized experts (a 2-layer
synthetic model), where a copy takes long enough for the clocks to see it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.packtools.synth.writer import SynthOptions, write_synth
from expertpack.worker.engine.engine import Engine

from ..conftest import FIXTURES, start_daemon
from ..helpers.engine import greedy_run as greedy, minimal_cache_bytes

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

FIXTURE_MODELS = {"qwen3moe-a": "qwen3moe-a.Q4_K_M.gguf", "gptoss-a": "gptoss-a.MXFP4_MOE.gguf"}


def pack_of(src: Path, out: Path) -> Path:
    build_pack(src, out, BuildOptions(progress=False, safety_margin_bytes=0))
    return out


@pytest.fixture(scope="module")
def big_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen3-30b-2L")
    src = root / "model.gguf"
    write_synth(src, SynthOptions(preset="qwen3-30b-a3b", n_layer=2, progress=False))
    return pack_of(src, root / "pack")


@pytest.mark.parametrize("model", sorted(FIXTURE_MODELS))
def test_minimal_cache_on_cuda_is_bit_exact(model: str, tmp_path: Path) -> None:
    pack = pack_of(FIXTURES / "gguf" / model / FIXTURE_MODELS[model], tmp_path / "pack")
    prompt = np.load(FIXTURES / "ref" / model / "prompt_ids.npy").tolist()
    d = start_daemon(pack, tmp_path, "--client-slots", "4")
    d.wait_for("READY=1")
    try:
        want_logits, want_tokens = greedy(Engine.load(pack, "cuda", resident_experts=True), prompt)
        engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            got_logits, got_tokens = greedy(engine, prompt)
            assert engine.expert_cache.link.pinned and engine.expert_cache.link.staging.is_pinned()
            print(f"{model}: {engine.expert_cache.counters.snapshot()}")
        finally:
            engine.close()
        assert got_tokens == want_tokens
        for step, (got, want) in enumerate(zip(got_logits, want_logits)):
            assert torch.equal(got, want), f"{model}: step {step} differs from the resident run"
    finally:
        assert d.stop()[0] == 0


def test_minimal_cache_on_cuda_over_the_ram_tier_is_bit_exact(tmp_path: Path) -> None:
    """READYs naming RAM tier slots: the GPU copies from the resident blocks through the same
    registered mapping as from staging; a second pass reads nothing from the pack."""
    model = "qwen3moe-a"
    pack = pack_of(FIXTURES / "gguf" / model / FIXTURE_MODELS[model], tmp_path / "pack")
    prompt = np.load(FIXTURES / "ref" / model / "prompt_ids.npy").tolist()
    d = start_daemon(pack, tmp_path, "--client-slots", "4", "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    try:
        want_logits, want_tokens = greedy(Engine.load(pack, "cuda", resident_experts=True), prompt)
        # Without prefetch: a mispredicted prefetch would read a block no layer used, and the counts
        # below are of the blocks the layers used (test_prefetch_on_cuda covers prefetch).
        engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=False)
        try:
            runs = [greedy(engine, prompt) for _ in range(2)]
            link = engine.expert_cache.link
            assert link.pinned and link.staging.is_pinned() and link.client.welcome.ram_slots > 0
            stats = engine.expert_cache.stats()
            print(f"{model} over the RAM tier: {stats}")
        finally:
            engine.close()
        for got_logits, got_tokens in runs:
            assert got_tokens == want_tokens
            for step, (got, want) in enumerate(zip(got_logits, want_logits)):
                assert torch.equal(got, want), f"{model}: step {step} differs from the resident run"
        daemon, ram = stats["daemon"], stats["daemon_ram"]
        # the whole pack fits the tier: each block read from the pack once, every later ask a hit
        assert daemon["ram_misses"] == ram["resident"] and ram["evictions"] == 0
        assert daemon["pack_read_bytes"] == ram["resident_bytes"] and daemon["ram_hits"] > 0
        assert stats["cache"]["misses"] > 2 * daemon["ram_misses"]  # the second pass came from the tier
    finally:
        assert d.stop()[0] == 0


@pytest.mark.parametrize("ram_gib", ["0", "1"])
def test_prefetch_on_cuda_is_bit_exact_and_leaves_nothing_held(ram_gib: str, tmp_path: Path) -> None:
    """Prefetched experts copied in on the copy stream from staging (or RAM tier) slots: the same
    bits as every expert resident; every prefetch ends used or cancelled, and no slot or hold stays
    with the worker once the answers of cancelled ones are in."""
    model = "qwen3moe-a"
    pack = pack_of(FIXTURES / "gguf" / model / FIXTURE_MODELS[model], tmp_path / "pack")
    prompt = np.load(FIXTURES / "ref" / model / "prompt_ids.npy").tolist()
    d = start_daemon(pack, tmp_path, "--client-slots", "8", "--ram-cache-gib", ram_gib)
    d.wait_for("READY=1")
    try:
        want_logits, want_tokens = greedy(Engine.load(pack, "cuda", resident_experts=True), prompt)
        engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            got_logits, got_tokens = greedy(engine, prompt)
            link = engine.expert_cache.link
            link.settle()
            stats = engine.expert_cache.stats()
            in_flight = len(engine.expert_cache._pending)  # copies not seen done yet keep their slot or hold
            prefetches_left = (len(link.ahead.entries), link.ahead.held)
            daemon_now = link.stats()
            (client,) = daemon_now["clients"]
            print(f"{model} with prefetch (RAM tier {ram_gib} GiB): {stats['cache']}")
        finally:
            engine.close()
        assert got_tokens == want_tokens
        for step, (got, want) in enumerate(zip(got_logits, want_logits)):
            assert torch.equal(got, want), f"{model}: step {step} differs from the resident run with prefetch on"
        c = stats["cache"]
        assert c["prefetch_used"] > 0 and c["prefetch_issued"] == c["prefetch_used"] + c["prefetch_stale"]
        assert stats["daemon"]["keys"] == c["misses"] - c["prefetch_used"] + c["prefetch_issued"]
        assert prefetches_left == (0, 0)
        # what it holds beside the blocks its cache keeps (v8): what copies not seen done yet hold
        unkept = client["ram_held"] - client["ram_kept"]
        assert client["slots"] - client["free"] + unkept <= in_flight and client["requests"] == 0
        assert daemon_now["ram"]["held"] <= client["ram_held"]
    finally:
        assert d.stop()[0] == 0


def test_copies_are_async_and_overlap_the_reads(big_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(big_pack, tmp_path)
    d.wait_for("READY=1")
    try:
        prompt = list(range(1000, 1032))
        want_logits, want_tokens = greedy(Engine.load(big_pack, "cuda", resident_experts=True), prompt, n=3)
        engine = Engine.load(big_pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(big_pack))
        try:
            cache = engine.expert_cache
            cache.timeline = []
            got_logits, got_tokens = greedy(engine, prompt, n=3)
            records = cache.timeline
            fetches: dict[int, list] = {}
            for r in records:
                fetches.setdefault(r.fetch, []).append(r)
            big = [rs for rs in fetches.values() if len(rs) >= 4]
            overlapped = [rs for rs in big if rs[0].done_s < rs[-1].arrived_s]
            running = sum(r.running_at_issue for r in records)
            copy_ms = np.median([(r.done_s - r.issued_s) * 1e3 for r in records])
            print(f"{len(records)} copies of {cache.slot_bytes / 2**20:.1f} MiB: {running} still running when the "
                  f"launch returned; {len(overlapped)}/{len(big)} fetches of >= 4 misses finished their first copy "
                  f"before their last expert arrived; median launch-to-done {copy_ms:.3f} ms; {cache.stats()}")
            assert engine.expert_cache.link.staging.is_pinned()
            assert running >= len(records) // 2, "copies out of the staging are not asynchronous"
            assert big and len(overlapped) >= len(big) // 2, "copies wait for the whole request to be read"
        finally:
            engine.close()
        assert got_tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    finally:
        assert d.stop()[0] == 0
