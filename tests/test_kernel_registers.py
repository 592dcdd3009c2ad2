"""bench/kernel_registers.py compiles the hot kernels for sm_90 on this GPU-less machine and reads
ptxas's figures and the main loops' instructions: the numbers the next kernel change is compared by."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs triton (pip install triton==3.6.0)")
SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "kernel_registers.py"


def test_every_hot_kernel_compiles_for_sm90_and_reports_its_registers() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    done = subprocess.run([sys.executable, str(SCRIPT), "--types", "Q4_K", "--sass"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"] for r in report["rows"]}
    assert {"matvec (trunk)", "experts gate+up (decode)", "tiles gate+up (prompt)"} <= kernels
    for r in report["rows"]:
        assert 16 <= r["registers"] <= 255 and r["programs_per_sm"] >= 1, r
    # --sass: the decode kernels' main loops, in SASS instructions a weight value (a Q4_K value costs
    # more than the two FMAs that decode it and meet x: loads, shifts, masks, the reduction).
    loops = {r["kernel"]: r for r in report["rows"] if "loop_per_value" in r}
    assert {"matvec (trunk)", "experts gate+up (decode)", "experts down (decode)"} <= loops.keys()
    for r in loops.values():
        assert 2 < r["loop_per_value"] < 100 and r["loop_top"].get("FFMA", 0) > 0, r
    # Q4_K experts' own tile kernels: a row mask, not one per value, and the activation once a pair
    for role in ("gate+up", "down"):
        assert loops[f"Q4_K tiles {role} (prompt)"]["loop_per_value"] < loops[f"tiles {role} (prompt)"]["loop_per_value"]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--types", "Q9_Z"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown ggml type" in bad.stderr
