"""bench/decode_workers.py at tiny scale on the CPU, as the GPU machine runs it at full scale: one
worker alone, then two worker processes on one expertd, each decoding the alone run's argmax at
every step; with the same stream, the two together read no more experts from the pack during
decode than one alone did (expertd's reads and RAM tier are shared), and each has its figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers.bench import bench


@pytest.mark.slow
def test_two_workers_on_one_expertd_share_its_reads(tmp_path: Path) -> None:
    result = bench(tmp_path, "--ram-cache-gib", "1")
    assert result["argmax_identical"] and len(result["alone"]) == 1 and len(result["together"]) == 2
    alone, together = result["alone"][0], result["together"]
    assert [f["device"] for f in together] == ["cpu", "cpu"]
    assert all(f["decode_tps"] > 0 and f["argmax_sha256"] == alone["argmax_sha256"] for f in together)
    assert alone["ram_misses"] > 0
    assert sum(f["ram_misses"] for f in together) <= alone["ram_misses"], (alone, together)
    assert sum(f["ram_hits"] for f in together) > alone["ram_hits"]


@pytest.mark.slow
def test_distinct_streams_each_match_their_own_alone_run(tmp_path: Path) -> None:
    result = bench(tmp_path, "--distinct", "--ram-cache-gib", "0")
    alone = {f["stream"]: f for f in result["alone"]}
    assert sorted(alone) == [0, 1] and alone[0]["argmax_sha256"] != alone[1]["argmax_sha256"]
    for f in result["together"]:
        assert f["argmax_sha256"] == alone[f["stream"]]["argmax_sha256"] and f["ram_hits"] == 0
        assert f["ssd_bytes_per_token"] > 0  # no RAM tier: every miss of its cache is a read for it
