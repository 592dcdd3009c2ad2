"""bench/peer_offload.py's arithmetic: which llama.cpp `-ncmoe` splits fit a VRAM budget (the
experts of the first K layers stay in host memory; llama-bench's JSON reads as in
bench/peer_llamacpp.py). The runs
themselves need a GPU, root and a llama.cpp build (BENCHMARKS.md has them)."""

from __future__ import annotations

import subprocess
import sys

from expertpack.bench.peer_offload import GIB, LLAMA_VRAM_MARGIN_GIB, Split, fitting, splits

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


def test_help_says_what_it_compares() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "peer_offload.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "-ncmoe" in proc.stdout and "cgroup" in proc.stdout
