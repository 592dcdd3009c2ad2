"""bench/decode_workers.py as the tests run it: tests/test_bench_workers.py on the CPU and
tests/gpu/test_two_workers.py on two GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO


def bench(tmp_path: Path, *flags: str) -> dict:
    """Runs the bench with two workers on the tiny preset (on the CPU unless `flags` say --device)
    and returns its JSON line, after checking its table says the argmax matched."""
    device = () if "--device" in flags else ("--device", "cpu")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "decode_workers.py"), "--workers", "2", *device,
                           "--preset", "tiny", "--cache-gib", "0.002", "--prompt", "8", "--decode", "10",
                           "--dir", str(tmp_path), *flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    logs = next(line.split()[2] for line in proc.stderr.splitlines() if line.startswith("logs in "))
    assert not Path(logs).exists(), f"a clean run left {logs} behind"
    lines = proc.stdout.splitlines()
    assert "identical to the alone run: True" in proc.stdout and "aggregate decode, 2 workers" in proc.stdout, \
        proc.stdout
    return json.loads(lines[-1])
