"""bench/host_bandwidth.py on the GPU (skipped without one): every kind of host memory the machine
can make is read by DMA and by the table step's gather, the gather's bytes checked against the
host's inside the run, and the copies beside HBM-bound kernels are timed; a kind the machine cannot
make (hugetlbfs without reserved pages) is reported, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ..conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_every_kind_is_read_or_says_why_not() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "host_bandwidth.py"), "--gib", "0.25", "--rounds", "4",
                           "--overlap", "16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["kind"]: r for r in report["rows"]}
    for kind in ("cudaHostAlloc", "shm read-only", "shm", "anon + MADV_HUGEPAGE"):
        assert rows[kind]["dma_gb_s"] > 1 and rows[kind]["gather_gb_s"] > 1, rows[kind]
    assert all("error" in r or r["gather_gb_s"] > 0 for r in rows.values())
    assert [r["copy"] for r in report["overlap"]] == ["DMA", "gather, 16 programs a block"]
    assert all(r["compute_beside_us"] > 0 and r["copy_beside_us"] > 0 for r in report["overlap"])
