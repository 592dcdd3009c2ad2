"""`expertpack bench serve --compare` draws earlier runs side by side. The two reports in data/ are
real bench-serve.json files: expert-worker serving the `tiny` preset on CPU, and llama-server (built
by bench/peer_llamacpp.py) serving the same GGUF; llama-server reports no hit rate, which must read
n/a, never 0%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertpack.bench.bench_serve import Result, Run, figure, make_report, percentile, table

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


def made_up(index: int, started_s: float, seconds: float, ttft_s: float, decode: float, set_name: str = "instruction",
             completion_tokens: int = 10) -> Result:
    return Result(set_name, index, 40, completion_tokens, 100.0 * (index + 1), decode, "server", None, None, seconds,
                  started_s, ttft_s)


def test_a_set_summary_is_its_tokens_over_its_wall_time_and_its_percentiles() -> None:
    np = pytest.importorskip("numpy")
    # Three requests two in flight: 0 and 1 sent at once, 2 when 0 was answered; the last answer at 3 s.
    rs = [made_up(0, 0.0, 2.0, 0.5, 20.0), made_up(1, 0.0, 3.0, 1.0, 10.0), made_up(2, 2.0, 0.5, 2.0, 30.0),
          made_up(0, 0.0, 4.0, 0.25, 5.0, "multiple-choice", 8)]
    report = make_report("http://x", "m", "made up", 10, rs, concurrency=2)
    s = report["summary"]["instruction"]
    assert s["wall_s"] == 3.0 and s["completion_tokens"] == 30 and s["aggregate_decode_tokens_per_s"] == 10.0
    assert s["decode_tokens_per_s"] == 20.0 and s["ttft_s_mean"] == pytest.approx(3.5 / 3)
    ttft, decode, prefill = [0.5, 1.0, 2.0], [20.0, 10.0, 30.0], [100.0, 200.0, 300.0]
    for key, values in (("ttft_s", ttft), ("decode_tokens_per_s", decode), ("prefill_tokens_per_s", prefill)):
        for q in (50, 90):
            assert s[f"{key}_p{q}"] == pytest.approx(np.percentile(values, q)), key
    assert s["ttft_s_p90"] == pytest.approx(1.8)
    one = report["summary"]["multiple-choice"]
    assert one["aggregate_decode_tokens_per_s"] == 2.0 and one["ttft_s_p50"] == one["ttft_s_p90"] == 0.25
    assert percentile([7.0], 0.9) == 7.0 and percentile([3.0, 1.0], 0.0) == 1.0 and percentile([3.0, 1.0], 1.0) == 3.0
    with pytest.raises(ValueError):
        percentile([], 0.5)

    run = Run.from_report(json.loads(json.dumps(report)))
    assert run.conditions["concurrency"] == 2
    header, row = table([run]).splitlines()[:2]
    assert "concurrency" in header and "aggregate tok/s" in header and "TTFT p90 s" in header
    assert row.split()[2:4] == ["instruction", "2"]


def test_reports_from_before_concurrency_read_one_at_a_time() -> None:
    ours = Run.load(OURS)
    assert ours.conditions["concurrency"] == 1
    rows = table([ours]).splitlines()[1:]
    assert all(row.split()[-5:-2] == ["n/a"] * 3 for row in rows), rows  # aggregate, TTFT mean, TTFT p90


def test_compare_refuses_what_is_not_a_report(tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"bench": "decode_streaming"}))
    proc = run_cli("bench", "serve", "--compare", OURS, bad, "--out", tmp_path)
    assert proc.returncode == 2 and "not a bench-serve.json" in proc.stderr and "Traceback" not in proc.stderr
    both = run_cli("bench", "serve", "--compare", OURS, "--endpoint", "http://127.0.0.1:9")
    assert both.returncode == 2 and "not allowed with" in both.stderr
