"""Faults: a client SIGKILLed mid-fetch loses its leases; SIGTERM stops the daemon cleanly (BYE to
clients, exit 0, no shared memory or socket left); a pack truncated under the daemon gives FAIL with
io_errors counted, never wrong bytes."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertpack.client import DaemonUnavailable, ExpertClient, FetchFailed
from expertpack.client import protocol as p
from expertpack.packtools.layout import PACK_FILE, Manifest

from ..conftest import Daemon, start_daemon

CLIENT_SCRIPT = """
import sys, time
from expertpack.client import ExpertClient
c = ExpertClient(sys.argv[1], name="doomed")
experts = []
for e in c.fetch([(0, i) for i in range(16)] + [(1, i) for i in range(16)], timeout_s=30):
    experts.append(e)          # holds every slot it gets and never releases
    if len(experts) == len(c.slots):
        print("holding", flush=True)
        time.sleep(600)
"""


def wait_stats(endpoint: str, pred, timeout: float = 10) -> dict:
    with ExpertClient(endpoint, name="observer") as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            if pred(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def test_sigkilled_client_loses_its_leases(daemon: Daemon) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, daemon.endpoint], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    stats = wait_stats(daemon.endpoint, lambda s: any(c["name"] == "doomed" for c in s["clients"]))
    assert stats["slots"]["leased"] == 8  # the doomed client holds all 8 of its slots
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stats = wait_stats(daemon.endpoint, lambda s: all(c["name"] != "doomed" for c in s["clients"]))
    assert [c["name"] for c in stats["clients"]] == ["observer"]
    assert stats["slots"]["leased"] == 0 and stats["slots"]["unleased"] == 48 - 8
    assert stats["counters"]["clients_dropped"] >= 1


def test_sigterm_says_bye_and_cleans_up(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    client = ExpertClient(d.endpoint, name="bystander")
    shm = Path("/dev/shm") / client.welcome.shm
    assert shm.exists()
    d.proc.send_signal(signal.SIGTERM)
    with pytest.raises(DaemonUnavailable, match="going away"):
        client.stats()
    client.close()
    code, err = d.stop()
    assert code == 0, err
    assert "STOPPING=1" in "".join(d.notes)
    assert not shm.exists() and not d.socket_path.exists()
    assert "SIGTERM received" in err


def test_truncated_pack_gives_fail_not_wrong_bytes(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    m = Manifest.load(pack)
    d = start_daemon(pack, tmp_path)
    d.wait_for("READY=1")
    try:
        last = m.layers[-1]
        with open(pack / PACK_FILE, "r+b") as f:
            f.truncate(last.block_offset(10) + 4096)  # experts 10.. of the last layer lose their bytes
        with ExpertClient(d.endpoint) as client:
            good = []
            for expert in client.fetch([(last.layer, e) for e in range(10)]):
                assert hashlib.sha256(expert.data).hexdigest() == last.sha256[expert.key.expert]
                good.append(expert.key.expert)
                expert.release()
            assert sorted(good) == list(range(10))
            for e in (10, 15):
                with pytest.raises(FetchFailed) as caught:
                    list(client.fetch([(last.layer, e)]))
                assert caught.value.code is p.FailCode.IO_ERROR and "short read" in str(caught.value)
            stats = client.stats()
        assert stats["counters"]["io_errors"] >= 2 and stats["counters"]["failed"] == 2
        assert stats["slots"]["reading"] == 0 and stats["slots"]["leased"] == 0
    finally:
        assert d.stop()[0] == 0
