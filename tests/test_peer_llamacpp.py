"""bench/peer_llamacpp.py: llama-bench's JSON read as llama-bench wrote it (data/ holds a real one,
from the CPU build of the vendored llama.cpp on the `tiny` preset), and expertpack timed the same
way on the tiny synthetic model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = Path(__file__).parent / "data" / "llama-bench-tiny-cpu.json"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_llamacpp", REPO / "bench" / "peer_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_llama_bench_json_gives_a_rate_per_test(peer) -> None:
    records = json.loads(SAMPLE.read_text())  # llama-bench -p 8,32 -n 4 -r 3 -o json
    rates, build = peer.parse_llama_bench(records)
    assert rates.tokens_per_s == {"pp8": records[0]["avg_ts"], "pp32": records[1]["avg_ts"],
                                  "tg4": records[2]["avg_ts"]}
    assert set(rates.stddev) == set(rates.tokens_per_s)
    assert build["build_commit"] == "0c1e570" and build["backends"] == "CPU"


def test_the_table_has_both_systems_and_their_ratio(peer) -> None:
    llama = peer.Rates({"tg4": 100.0, "pp8": 400.0}, {})
    ours = peer.Rates({"tg4": 80.0, "pp8": 100.0}, {})
    lines = peer.table(["tg4", "pp8"], llama, ours).splitlines()
    assert lines[0].split() == ["tg4", "tok/s", "pp8", "tok/s"]
    assert lines[3].split()[-2:] == ["0.800", "0.250"]


def test_fetch_keeps_what_the_build_reads(peer) -> None:
    assert peer._dropped("models/ggml-vocab-qwen2.gguf") and peer._dropped("ggml/src/ggml-vulkan/x.cpp")
    assert not peer._dropped("ggml/src/ggml-cuda/mmq.cu") and not peer._dropped("tools/ui/ui.cpp.in")
    assert not peer._dropped("tools/llama-bench/llama-bench.cpp") and not peer._dropped("modelsx")


def test_expertpack_is_timed_per_test_and_its_output_hashed(peer, tiny_gguf: Path) -> None:
    first = peer.measure_expertpack(tiny_gguf, "cpu", [8, 16], 4, 2)
    assert set(first.rates.tokens_per_s) == {"pp8", "pp16", "tg4"}
    assert all(v > 0 for v in first.rates.tokens_per_s.values())
    again = peer.measure_expertpack(tiny_gguf, "cpu", [8], 4, 1)
    assert again.argmax_sha256 == first.argmax_sha256  # the same fixed token stream, the same model
