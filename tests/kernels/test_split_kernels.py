"""A worker split over devices (issue 16) on the fast path: under Triton's interpreter on the CPU
(`cpu,cpu`), the fused layers, static-shape decode steps (the step's position read on each range's
device) and the experts' offset maps into each device's resident table or expert cache give one
device's logits bit for bit. Here, not in tests/worker, because the interpreter must be on before
the kernels are defined (conftest.py); tests/gpu/test_multi_gpu.py runs the same over two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.nn.backend import kernels_on_cpu

from ..helpers.engine import PROMPT, assert_same, daemon_for, greedy_run, minimal_cache_bytes


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, tests/gpu/test_multi_gpu.py runs the kernels on CUDA")
@pytest.mark.usefixtures("interpreter_tiles")
def test_split_through_the_kernels_is_bit_identical(split_packs, tmp_path: Path) -> None:
    """The GPU's code path on the CPU (Triton's interpreter): fused layers, decode as static-shape
    steps (the position a device tensor each range reads on its own device), experts through the
    kernels' offset maps into each device's resident table or its expert cache. ~1.5 min."""
    pack = split_packs["qwen3moe"]
    d = daemon_for(pack, tmp_path)
    try:
        with kernels_on_cpu():
            want = greedy_run(Engine.load(pack, resident_experts=True), PROMPT, 2)
            split = Engine.load(pack, "cpu,cpu", resident_experts=True)
            assert_same(greedy_run(split, PROMPT, 2), want, "resident over cpu,cpu, through the kernels")
            engine = Engine.load(pack, "cpu,cpu", daemon=d.endpoint, cache_bytes=2 * minimal_cache_bytes(pack))
            try:
                got = greedy_run(engine, PROMPT, 2)
                assert all(c.counters.misses > c.n_slots for c in engine.expert_cache.caches)  # evictions on both
            finally:
                engine.close()
    finally:
        assert d.stop()[0] == 0
    assert_same(got, want, "expert caches over cpu,cpu, through the kernels")
