"""`expertpack bench serve --compare` draws earlier runs side by side. The two reports in data/ are
real bench-serve.json files: expert-worker serving the `tiny` preset on CPU, and llama-server (built
by bench/peer_llamacpp.py) serving the same GGUF; llama-server reports no hit rate, which must read
n/a, never 0%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertpack.bench.bench_serve import Run, figure

from ..conftest import run_cli

DATA = Path(__file__).parent / "data"
OURS, LLAMA = DATA / "bench-serve-expert-worker.json", DATA / "bench-serve-llama-server.json"


def test_the_reports_are_what_each_server_measured() -> None:
    ours, llama = Run.load(OURS), Run.load(LLAMA)
    assert all(0 <= s["hit_rate"] <= 1 for s in ours.summary.values())
    assert all(s["hit_rate"] is None and s["fetched_gb_per_token"] is None for s in llama.summary.values())


def test_compare_prints_one_table_and_draws_one_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = run_cli("bench", "serve", "--compare", OURS, LLAMA, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    ours, llama = Run.load(OURS).label, Run.load(LLAMA).label
    rows = {(label, name): line for line in lines[1:-1] for label in (ours, llama) for name in ("instruction",
            "multiple-choice") if line.startswith(label) and name in line}
    assert len(rows) == 4 and len(lines) == 6, proc.stdout
    for name in ("instruction", "multiple-choice"):
        assert rows[llama, name].split()[-2:] == ["n/a", "n/a"]
        assert rows[ours, name].split()[-2].endswith("%")
    report = json.loads(lines[-1])
    assert report["bench"] == "serve-compare" and [r["label"] for r in report["runs"]] == [ours, llama]
    assert report["runs"][1]["summary"]["instruction"]["hit_rate"] is None
    assert (tmp_path / "bench-serve-compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_chart_reads_n_a_where_a_server_reports_no_hit_rate() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    ours, llama = Run.load(OURS), Run.load(LLAMA)
    fig = figure([ours, llama], "side by side")
    hit_panel = fig.axes[2]
    labels = [t.get_text() for t in hit_panel.texts]
    assert labels.count("n/a") == 2 and "0%" not in labels  # one bar per set for each run
    assert len([t for t in labels if t.endswith("%")]) == 2
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [ours.label, llama.label]
    plt.close(fig)


def test_compare_refuses_what_is_not_a_report(tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"bench": "decode_streaming"}))
    proc = run_cli("bench", "serve", "--compare", OURS, bad, "--out", tmp_path)
    assert proc.returncode == 2 and "not a bench-serve.json" in proc.stderr and "Traceback" not in proc.stderr
    both = run_cli("bench", "serve", "--compare", OURS, "--endpoint", "http://127.0.0.1:9")
    assert both.returncode == 2 and "not allowed with" in both.stderr
