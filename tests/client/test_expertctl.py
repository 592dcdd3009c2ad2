"""expertctl against a real daemon: a readable table, JSON for scripts, exit codes for health checks
(0 ok, 1 degraded, 2 down). It never takes staging slots."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from expertpack.client import ExpertClient
from expertpack.client.expertctl import main as expertctl_main
from expertpack.client.expertctl import render

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
    assert health.returncode == 2 and "cannot reach expertd" in health.stderr


def test_no_socket_or_a_dead_one_is_answered_at_once(tmp_path: Path) -> None:
    """ZeroMQ would wait the whole --timeout-s for a daemon that is not there."""
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))  # closed unlistened: the file stays and refuses connections, as a killed expertd's
    for path, why in ((tmp_path / "none.sock", "there is no socket at"), (dead, "refuses connections")):
        start = time.monotonic()
        ping = expertctl("ping", "--endpoint", f"ipc://{path}", "--timeout-s", "60")
        assert ping.returncode == 2 and why in ping.stderr, ping
        assert time.monotonic() - start < 10
        health = expertctl("health", "--endpoint", f"ipc://{path}", "--timeout-s", "60", "--json")
        assert health.returncode == 2 and json.loads(health.stdout)["status"] == "down", health


def test_each_command_has_its_own_help(capsys: pytest.CaptureFixture) -> None:
    helps = {}
    for command in ("stats", "ping", "health"):
        with pytest.raises(SystemExit) as done:
            expertctl_main([command, "--help"])
        assert done.value.code == 0
        helps[command] = capsys.readouterr().out
        assert helps[command].startswith(f"usage: expertctl {command}") and "--endpoint" in helps[command]
    assert "--watch" in helps["stats"] and "--watch" not in helps["ping"] + helps["health"]
    assert "Exit 0 when" in helps["health"] and "PONG" in helps["ping"]


def test_a_cancelled_prefetch_is_counted_once(daemon: Daemon) -> None:
    """expertd's `failed` counts every FAIL, the FAIL CANCELLED of a cancel included: the table
    shows that answer as cancelled, not also as failed."""
    with ExpertClient(daemon.endpoint, name="cancels") as client:
        stats = client.stats()
    stats["counters"].update(fetches=1, keys=1, ready=0, failed=1, cancelled=1)
    stats["clients"][0].update(keys=1, ready=0, failed=1)
    table = render(stats, None, None)
    assert "ready 0  cancelled 1  failed 0" in table, table
    assert "failed or cancelled 1" in table, table


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
CONNECT_SCRIPT = """
import sys
from expertpack.client import ClientError, ExpertClient
try:
    ExpertClient(sys.argv[1], timeout_s=20)
except ClientError as exc:
    print(exc)
"""


def test_a_socket_this_user_may_not_use_is_named_as_such(daemon: Daemon) -> None:
    """Another user than expertd's group: told at once that permission is denied, not, after a
    timeout, to check whether expertd is running."""
    import sys
    import time

    start = time.monotonic()
    client = subprocess.run([*AS_NOBODY, sys.executable, "-c", CONNECT_SCRIPT, daemon.endpoint],
                            capture_output=True, text=True, timeout=60)
    assert "permission denied on" in client.stdout and "is it running" not in client.stdout, client
    assert time.monotonic() - start < 15, "it waited for the timeout"
    ctl = subprocess.run([*AS_NOBODY, str(BIN / "expertctl"), "ping", "--endpoint", daemon.endpoint, "--timeout-s", "1"],
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 2 and "permission denied on" in ctl.stderr, ctl


def test_no_daemon_and_bad_flags_are_named(tmp_path: Path) -> None:
    gone = expertctl("ping", "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout-s", "0.5")
    assert gone.returncode == 2 and f"there is no socket at {tmp_path}/none.sock" in gone.stderr, gone
    for flag, value in (("--timeout-s", "inf"), ("--timeout-s", "nan"), ("--watch", "-1")):
        bad = expertctl("stats", "--endpoint", f"ipc://{tmp_path}/none.sock", flag, value)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and f"{flag} must lie in" in bad.stderr, bad
