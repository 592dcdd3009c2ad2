"""bench/peer_offload.py's arithmetic: which llama.cpp `-ncmoe` splits fit a VRAM budget (the
experts of the first K layers stay in host memory; llama-bench's JSON reads as in
bench/peer_llamacpp.py), and how --rounds makes one result of several runs. The runs themselves
need a GPU, root and a llama.cpp build (BENCHMARKS.md has them)."""

from __future__ import annotations

import subprocess
import sys

from expertpack.bench.peer_offload import GIB, LLAMA_VRAM_MARGIN_GIB, Split, fitting, median_of_rounds, splits

from ..conftest import REPO


def test_every_split_moves_the_first_layers_experts_to_host_memory() -> None:
    by_layer = {1: 10, 2: 20, 3: 30}  # layer 0 dense: no routed experts, so -ncmoe 1 is -ncmoe 0
    got = splits(100, by_layer, 4)
    assert got == [Split(0, 160, 0), Split(2, 150, 10), Split(3, 130, 30), Split(4, 100, 60)]


def test_only_splits_that_fit_the_vram_with_the_margin_count() -> None:
    margin = int(LLAMA_VRAM_MARGIN_GIB * GIB)
    all_ = splits(2 * GIB, {0: GIB, 1: GIB, 2: GIB}, 3)  # 5, 4, 3, 2 GiB of weights
    assert [s.ncmoe for s in fitting(all_, 4 * GIB + margin)] == [1, 2, 3]
    assert fitting(all_, 2 * GIB + margin - 1) == []


def test_rounds_report_each_rates_median_and_keep_every_failure() -> None:
    """Three runs of one side: each rate's median over the runs that measured it (the failed run
    measured none), the largest memory peak, OOM kills summed, errors and the lowest hit rate kept,
    every run's rates listed in order."""
    runs = [{"rates": {"pp32": 190.0, "tg32": 368.0}, "peak_bytes": 5 * GIB, "oom_kills": 0, "hit_rate": 1.0},
            {"rates": {}, "peak_bytes": None, "oom_kills": 1, "error": "llama-bench printed no results"},
            {"rates": {"pp32": 200.0, "tg32": 329.0}, "peak_bytes": 6 * GIB, "oom_kills": 0, "hit_rate": 0.9}]
    got = median_of_rounds(runs)
    assert got["rates"] == {"pp32": 195.0, "tg32": 348.5}
    assert got["peak_bytes"] == 6 * GIB and got["oom_kills"] == 1 and got["hit_rate"] == 0.9
    assert got["error"] == "llama-bench printed no results"
    assert got["rounds"] == [r["rates"] for r in runs]
    one = median_of_rounds(runs[:1])
    assert one["rates"] == runs[0]["rates"] and "error" not in one


def test_help_says_what_it_compares() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "peer_offload.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "-ncmoe" in proc.stdout and "cgroup" in proc.stdout
