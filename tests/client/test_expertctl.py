"""expertctl against a real daemon: a readable table, JSON for scripts, exit codes for health checks
(0 ok, 1 degraded, 2 down). It never takes staging slots."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from expertpack.client import ExpertClient

from ..conftest import BIN
from ..conftest import Daemon, start_daemon


def expertctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "expertctl"), *args], capture_output=True, text=True, timeout=30)


def test_stats_table_and_json(daemon: Daemon) -> None:
    with ExpertClient(daemon.endpoint, name="busy-worker") as client:
        for expert in client.fetch([(0, i) for i in range(16)]):
            expert.release()
        table = expertctl("stats", "--endpoint", daemon.endpoint)
        assert table.returncode == 0, table.stderr
        for text in ("read_latency_us", "p50", "p99", "io_errors 0", "busy-worker", "slots", "O_DIRECT", "ready 16"):
            assert text in table.stdout, table.stdout
        data = json.loads(expertctl("stats", "--endpoint", daemon.endpoint, "--json").stdout)
        assert data["counters"]["ready"] == 16
        assert [c["name"] for c in data["clients"]] == ["busy-worker"]  # expertctl holds no session


def test_watch_prints_rates(daemon: Daemon) -> None:
    proc = subprocess.Popen([str(BIN / "expertctl"), "stats", "--endpoint", daemon.endpoint, "--watch", "0.2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(30)]
    finally:
        proc.terminate()
        proc.wait()
    assert any("GB/s" in line and "experts/s" in line for line in lines)


def test_ping_and_health(daemon: Daemon) -> None:
    ping = expertctl("ping", "--endpoint", daemon.endpoint)
    assert ping.returncode == 0 and "pong" in ping.stdout
    health = expertctl("health", "--endpoint", daemon.endpoint, "--json")
    assert health.returncode == 0 and json.loads(health.stdout)["status"] == "ok"


def test_health_of_a_degraded_daemon(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path, "--no-direct-io")
    d.wait_for("READY=1")
    try:
        health = expertctl("health", "--endpoint", d.endpoint)
        assert health.returncode == 1 and "page cache" in health.stdout
    finally:
        assert d.stop()[0] == 0


def test_health_of_nothing(tmp_path: Path) -> None:
    health = expertctl("health", "--endpoint", f"ipc://{tmp_path}/nobody.sock", "--timeout-s", "0.5")
    assert health.returncode == 2 and "no answer" in health.stderr
