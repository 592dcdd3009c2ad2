"""A worker started before its daemon, or without one: it says at once that it waits for expertd
and why (no socket yet), looks again with backoff, and uses a daemon that comes within
--daemon-timeout-s; none coming, it ends with one line and exit status 2."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from expertpack.client import DaemonUnavailable
from expertpack.packtools.layout import Manifest
from expertpack.worker.experts.daemon_link import DaemonLink

from ..conftest import BIN, free_port, start_daemon


def test_a_worker_without_a_daemon_says_so_at_once_and_exits_2(tiny_pack: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/expertd.sock"
    proc = subprocess.Popen([str(BIN / "expert-worker"), "--pack", str(tiny_pack), "--daemon", endpoint,
                             "--device", "cpu", "--port", str(free_port()), "--daemon-timeout-s", "3"],
                            stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    try:
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip()))
        assert proc.wait(timeout=120) == 2
    finally:
        proc.kill()
        proc.wait()
    said = [(t, line) for t, line in lines if f"waiting for expertd at {endpoint} (no socket yet)" in line]
    assert said, lines
    errors = [(t, line) for t, line in lines if "ERROR" in line]
    assert len(errors) == 1 and f"no expertd at {endpoint}" in errors[0][1] and "Traceback" not in str(lines), lines
    assert errors[0][0] - said[0][0] > 2.0, "it said so only when it gave up"


def test_a_daemon_that_comes_while_the_link_waits_is_used(tiny_pack: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"ipc://{tmp_path}/expertd.sock"
    made: list = []

    def link() -> None:
        made.append(DaemonLink(endpoint, Manifest.load(tiny_pack).fingerprint, torch.device("cpu"), timeout_s=60))

    caplog.set_level(logging.INFO, logger="expert-worker")
    waiting = threading.Thread(target=link)
    waiting.start()
    time.sleep(1.5)  # longer than the daemon's heartbeat timeout: still not a stopped process
    d = start_daemon(tiny_pack, tmp_path, "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "0.5")
    try:
        d.wait_for("READY=1")
        waiting.join(timeout=60)
        assert made, "no link"
        try:
            for expert in made[0].fetch([(0, 1)]):
                expert.release()
            assert made[0].reconnects == 0
        finally:
            made[0].close()
    finally:
        code, err = d.stop()
        assert code == 0, err
    assert f"waiting for expertd at {endpoint} (no socket yet)" in caplog.text
    assert f"expertd is up at {endpoint}" in caplog.text


def test_a_link_to_no_daemon_gives_up_after_its_timeout(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/expertd.sock"
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="no socket at"):
        DaemonLink(endpoint, None, torch.device("cpu"), timeout_s=1.0)
    assert 0.9 < time.monotonic() - start < 5
