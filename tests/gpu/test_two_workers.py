"""Two worker processes, one on each of two GPUs, against one expertd (issue 16, item 2; skipped
where fewer than two CUDA devices are visible; run on nvidia-h200-x2): bench/decode_workers.py at
tiny scale, worker 0 on cuda:0 and worker 1 on cuda:1, each decoding the argmax of one worker alone
at every step, the same stream sharing expertd's reads (together they read no more of the pack
during decode than one alone), and a stream each matching its own alone run."""

from __future__ import annotations

import pytest
import torch

from ..helpers.bench import bench

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

DEVICES = ("--device", "cuda:0,cuda:1")


def test_two_gpus_two_workers_share_one_expertd(tmp_path) -> None:
    result = bench(tmp_path, *DEVICES, "--ram-cache-gib", "1")
    alone, together = result["alone"][0], result["together"]
    assert result["argmax_identical"] and [f["device"] for f in together] == ["cuda:0", "cuda:1"]
    assert all(f["argmax_sha256"] == alone["argmax_sha256"] and f["decode_tps"] > 0 for f in together)
    assert sum(f["ram_misses"] for f in together) <= alone["ram_misses"], (alone, together)


def test_two_gpus_two_workers_with_a_stream_each(tmp_path) -> None:
    result = bench(tmp_path, *DEVICES, "--distinct", "--ram-cache-gib", "0")
    alone = {f["stream"]: f for f in result["alone"]}
    assert all(f["argmax_sha256"] == alone[f["stream"]]["argmax_sha256"] for f in result["together"])
