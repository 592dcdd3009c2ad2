"""`expertpack bench io` runs all three paths on a real pack and reports what it measured: the same
bytes for each path, finite rates, and the ratios the goals are stated in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertpack.packtools.layout import Manifest

from ..conftest import run_cli


@pytest.mark.slow
def test_bench_io_reports_three_paths(tiny_pack: Path) -> None:
    proc = run_cli("bench", "io", tiny_pack, "--gb", "0.003", "--latency-requests", "5", "--read-threads", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    m = Manifest.load(tiny_pack)
    paths = {r["path"]: r for r in report["results"]}
    assert set(paths) == {"fio", "expertd", "buffered"}
    n = report["experts"]
    assert paths["expertd"]["bytes_read"] == paths["buffered"]["bytes_read"] == n * m.max_stride
    assert abs(paths["fio"]["bytes_read"] - n * m.max_stride) < 4 * 65536  # fio rounds to whole reads
    for r in paths.values():
        assert r["gb_per_s"] > 0 and r["cpu_s_per_gb"] >= 0 and 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
    assert report["expertd_over_fio"] == pytest.approx(paths["expertd"]["gb_per_s"] / paths["fio"]["gb_per_s"], rel=1e-2)
    assert "expertd / fio throughput" in proc.stdout
