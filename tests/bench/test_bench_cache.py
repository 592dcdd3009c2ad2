"""`expertpack bench cache`: the worker's policy replayed exactly as the expert cache runs it (the same
hits and misses as a real ExpertCache fed by a real expertd on a fixture model), and the command's
output. The policies themselves are tested in tests/worker/test_cache_replay.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.packtools.layout import Manifest
from expertpack.planner.cache_replay import pack_slot_bytes, replay
from expertpack.worker.experts.routing_trace import read_trace

from ..conftest import BIN, FIXTURES, run_cli, start_daemon


@pytest.fixture(scope="module")
def qwen_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-cache") / "pack"
    build_pack(FIXTURES / "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf", out,
               BuildOptions(progress=False, safety_margin_bytes=0))
    return out


def test_the_policy_in_use_replays_the_expert_caches_own_counts(qwen_pack: Path, tmp_path: Path) -> None:
    """A real expertd, `expertpack eval --daemon` with an 8-slot cache (half the fixture's experts)
    recording a trace: replaying it, the policy in use has exactly the cache's hits and misses,
    and Belady at least as many hits."""
    daemon = start_daemon(qwen_pack, tmp_path, "--client-slots", "8")
    try:
        daemon.wait_for("READY=1")
        trace_path = tmp_path / "run.jsonl"
        proc = subprocess.run([str(BIN / "expertpack"), "eval", str(qwen_pack), "--text", "The quick brown fox jumps",
                               "--greedy", "24", "--temperature", "1", "--seed", "3", "--daemon", daemon.endpoint,
                               "--cache-vram-mib", "1", "--cache-reserve-mib", "0", "--trace", str(trace_path),
                               "--json"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    finally:
        assert daemon.stop()[0] == 0
    cache = json.loads(proc.stdout)["expert_cache"]["cache"]
    slots = 1 * 2**20 // pack_slot_bytes(Manifest.load(qwen_pack))
    assert cache["slots"] == slots == 8
    trace = read_trace(trace_path)
    assert trace.n_tokens == len(json.loads(proc.stdout)["prompt"]) + 24 - 1  # the last token is not run
    (row,) = replay(trace, [slots])
    assert round(row.hit_rate["in_use"] * row.requests) == cache["hits"]
    assert row.requests == cache["hits"] + cache["misses"]
    assert row.hit_rate["belady"] >= row.hit_rate["in_use"]

    out = run_cli("bench", "cache", trace_path, "--pack", qwen_pack, "--slots", "2", "8", "16", "--share", "0.25",
                  check=True)
    lines = out.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["bench"] == "cache" and report["slot_bytes"] == pack_slot_bytes(Manifest.load(qwen_pack))
    assert [r["slots"] for r in report["rows"]] == [2, 4, 8, 16]
    full = report["rows"][-1]["hit_rate"]  # every expert fits: only first uses miss, for everyone
    assert len(set(full.values())) == 1
    assert any(line.split()[:1] == ["8"] for line in lines)
    bad = run_cli("bench", "cache", trace_path, "--slots", "1")
    assert bad.returncode == 2 and "top-k" in bad.stderr


def test_the_bench_does_not_import_torch() -> None:
    """It replays the worker's policy and reads its trace format, both plain Python: it starts at once."""
    import sys

    code = "import sys, expertpack.bench.bench_cache; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
