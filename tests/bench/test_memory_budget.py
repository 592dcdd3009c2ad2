"""bench/memory_budget.py holds a command to a RAM budget with a memory cgroup of its own: a
command that stays under it runs and its peak is recorded; one that goes over is killed by the
kernel, and the exit status and the cgroup's count say so. Needs root and a memory cgroup (v1 or
v2), as the comparison it serves does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expertpack.bench.memory_budget import BudgetError, MemoryBudget

from ..conftest import REPO

SCRIPT = REPO / "bench" / "memory_budget.py"
TOUCH = "b = bytearray({mib} << 20); b[::4096] = b'x' * len(b[::4096])"  # resident, not just reserved


def cgroup_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root")
    try:
        with MemoryBudget(1 << 30):  # made and removed: this host lets us
            pass
    except BudgetError as exc:
        pytest.skip(str(exc))


def budget(gib: str, mib: int, *flags: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gib", gib, *flags, "--", sys.executable, "-c",
                           TOUCH.format(mib=mib)], capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_command_under_its_budget_runs_and_its_peak_is_recorded() -> None:
    cgroup_or_skip()
    code, report = budget("1", 200, "--keep-cache")
    assert code == 0 and report["returncode"] == 0 and report["oom_kills"] == 0
    assert 200 << 20 < report["peak_bytes"] < 1 << 30
    assert report["page_cache_dropped"] is False


def test_a_command_over_its_budget_is_killed_and_says_so() -> None:
    cgroup_or_skip()
    code, report = budget("0.15", 400)
    assert code == report["returncode"] == 128 + 9  # SIGKILL from the kernel's OOM killer
    assert report["oom_kills"] >= 1 and report["peak_bytes"] <= 0.15 * (1 << 30) + (1 << 20)
    assert report["page_cache_dropped"] is True


def test_bad_input_is_one_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gib", "-1", "--", "true"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--gib" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gib", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "command" in proc.stderr
