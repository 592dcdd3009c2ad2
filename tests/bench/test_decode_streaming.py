"""bench/decode_streaming.py end to end on the CPU with the tiny preset (a real expertd, a VRAM
cache of 30% of the experts over a RAM tier): every run's argmax is the resident run's, `--set`
reaches the worker's modules for the call and a bad one is refused before anything runs, and
`--trace` leaves a chrome trace of the decode steps. Its speeds mean something on a GPU only
(BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO

SCRIPT = str(REPO / "bench" / "decode_streaming.py")


def test_a_run_with_settings_and_a_trace(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--device", "cpu", "--dir", str(tmp_path / "out"),
                           "--cache-gib", "0.002", "--ram-cache-gib", "0.01", "--prompt", "8", "--decode", "6",
                           "--passes", "2", "--prefetch", "on", "--set", "experts.lookahead.LOOKAHEAD_LAYERS=2",
                           "--trace", str(tmp_path / "trace")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["argmax_identical"] and report["settings"] == "experts.lookahead.LOOKAHEAD_LAYERS=2"
    assert report["lookahead_layers"] == 2  # the setting reached the module the worker reads
    assert "prefetch 2 MoE layers ahead" in proc.stdout
    # no GPU: the PCIe bound is the nominal rate, said so, and it divides the bytes the tier gave a token
    assert report["pcie_gb_per_s"] == 55.0 and report["pcie_measured_by"].startswith("nominal")
    run_ = report["streaming"]["prefetch_on"]
    if run_["decode"]["kept_hits"]:
        assert run_["pcie_bound_decode_tokens_per_s"] > 0 and "PCIe bound (55.00 GB/s, nominal" in proc.stdout
    trace = json.loads((tmp_path / "trace" / "decode-prefetch-on.json").read_text())
    assert any(e.get("name") == "aten::mm" or e.get("cat") == "cpu_op" for e in trace["traceEvents"])


def test_a_setting_that_names_no_constant_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--device", "cpu", "--dir", str(tmp_path),
                           "--set", "routing_tl.NO_SUCH_CONSTANT=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--set: 'routing_tl.NO_SUCH_CONSTANT=3': want MODULE.CONSTANT=VALUE" in proc.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was synthesized
