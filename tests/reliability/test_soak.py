"""scripts/soak.py against a real expertd, as part of the suite: at least 100,000 hostile messages from
fuzzer processes that reconnect every few hundred messages, a churning client that comes back
under routing ids it just used (taking over its own live session with reads in flight) and checks
the bytes in the staging, and a well-behaved client checking every block it is served, all at once.
Afterwards, asked here and not only by the script: the daemon is alive and its RSS bounded, every
slot has come back, every key of the pack is served byte-exact, and SIGTERM still stops it cleanly
(the `daemon` fixture checks that no socket or segment is left). Longer runs: scripts/soak.py
--help; figures in BENCHMARKS.md (RELIABILITY)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from expertpack.client import ExpertClient
from expertpack.packtools.layout import Manifest

from ..conftest import REPO, Daemon
from ..helpers.expertd import wait_stats

SOAK = REPO / "scripts" / "soak.py"


def test_soak_help_says_what_it_does() -> None:
    proc = subprocess.run([sys.executable, str(SOAK), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for words in ("--duration-s", "--messages", "--endpoint", "--pid", "--shared-ids", "JSON"):
        assert words in proc.stdout, words


@pytest.mark.slow
def test_100k_hostile_messages_with_churn_leave_nothing_behind(daemon: Daemon, tiny_pack: Path) -> None:
    rss_start = psutil.Process(daemon.proc.pid).memory_info().rss
    proc = subprocess.run([sys.executable, str(SOAK), "--endpoint", daemon.endpoint, "--pid", str(daemon.proc.pid),
                           "--pack", str(tiny_pack), "--messages", "100000", "--churners", "2", "--progress-s", "5",
                           "--seed", "7"],
                          capture_output=True, text=True, timeout=400)
    assert proc.stdout.strip(), proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(summary))
    warnings = [line for line in daemon.log.splitlines() if " WARNING " in line or " ERROR " in line][-20:]
    assert proc.returncode == 0, (summary["first_violations"], proc.stderr[-3000:], warnings)
    assert "soak:" in proc.stderr and "messages in" in proc.stderr  # progress and the summary line
    roles = summary["by_role"]
    assert roles["fuzzer"]["messages"] + roles["churner"]["messages"] >= 100_000
    assert summary["daemon_counters"]["protocol_errors"] > 50_000  # refused, one ERROR each
    assert roles["fuzzer"]["sessions"] > 10 and summary["daemon_counters"]["clients_total"] > 100  # reconnected
    assert roles["churner"]["sessions"] > 20 and roles["churner"]["keys"] > 20  # came back, checked bytes
    assert roles["checker"]["keys"] > 100
    assert summary["crashes"] == 0 and summary["leaked_slots"] == 0 and summary["mismatches"] == 0
    assert summary["violations"] == 0

    assert daemon.proc.poll() is None, daemon.log
    rss_end = psutil.Process(daemon.proc.pid).memory_info().rss
    assert rss_end - rss_start < 64 << 20, f"RSS {rss_start / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB"
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint, name="after") as client:
        for expert in client.fetch([(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]):
            assert hashlib.sha256(expert.data).hexdigest() == m.layer(expert.key.layer).sha256[expert.key.expert]
            expert.release()
    stats = wait_stats(daemon.endpoint, lambda s: [c["name"] for c in s["clients"]] == ["observer"])
    assert [c["name"] for c in stats["clients"]] == ["observer"], stats["clients"]
    assert stats["slots"]["unleased"] == stats["slots"]["total"] - 8 and stats["slots"]["leased"] == 0
    assert stats["slots"]["reading"] == 0 and stats["queue_depth"]["keys"] == 0
    assert "Traceback" not in daemon.log
