"""Faults: a client SIGKILLed mid-fetch loses its leases; SIGTERM stops the daemon cleanly (BYE to
clients, exit 0, no shared memory or socket left), and so do SIGHUP, SIGUSR1 and SIGUSR2; a pack
truncated under the daemon gives FAIL TRUNCATED saying so, io_errors counted, never wrong bytes; a daemon SIGKILLed leaves a socket file and a segment that
the next one clears, while a live daemon's socket is never taken over."""

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
from ..helpers.expertd import wait_stats

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


def test_sigkilled_client_loses_its_leases(daemon: Daemon) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, daemon.endpoint], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    stats = wait_stats(daemon.endpoint, lambda s: any(c["name"] == "doomed" for c in s["clients"]))
    assert stats["slots"]["leased"] == 8  # the doomed client holds all 8 of its slots
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Only this observer left: the doomed client dropped, and the first observer too, whose
    # disconnect expertd may learn of (from its socket monitor) after this one's first STATS.
    stats = wait_stats(daemon.endpoint, lambda s: [c["name"] for c in s["clients"]] == ["observer"])
    assert [c["name"] for c in stats["clients"]] == ["observer"]
    assert stats["slots"]["leased"] == 0 and stats["slots"]["unleased"] == 48 - 8
    assert stats["counters"]["clients_dropped"] >= 1


def test_sigterm_says_bye_and_cleans_up(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    with ExpertClient(d.endpoint, name="bystander") as client:
        shm = Path("/dev/shm") / client.welcome.shm
        assert shm.exists()
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(DaemonUnavailable, match="going away"):
            for _ in range(1000):  # answers may still come until the signal is handled; then BYE
                client.ping()
                time.sleep(0.01)
    d.proc.wait(timeout=30)  # one SIGTERM: stop() must not send a second one into the exit
    code, err = d.stop()
    assert code == 0, err
    assert "STOPPING=1" in "".join(d.notes)
    assert not shm.exists() and not d.socket_path.exists()
    assert "SIGTERM received" in err


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: s.name)
def test_hangup_and_user_signals_stop_the_daemon_as_sigterm_does(tiny_pack: Path, tmp_path: Path,
                                                                  sig: signal.Signals) -> None:
    """Issue 37: SIGHUP or SIGUSR1 took their default action, and the shared memory and the socket
    stayed until the next start. expertd has no reload: each is a clean shutdown, as SIGTERM."""
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    with ExpertClient(d.endpoint, name="bystander") as client:
        shm = Path("/dev/shm") / client.welcome.shm
        d.proc.send_signal(sig)
        d.proc.wait(timeout=30)
        with pytest.raises(DaemonUnavailable, match="going away"):
            client.ping()
    code, err = d.stop()
    assert code == 0, err
    assert not shm.exists() and not d.socket_path.exists()
    assert f"{sig.name} received: shutting down" in err and "STOPPING=1" in "".join(d.notes)


def test_restart_after_sigkill_clears_what_the_dead_daemon_left(tiny_pack: Path, tmp_path: Path) -> None:
    dirs = [tmp_path / name for name in ("first", "rival", "second")]
    for d in dirs:
        d.mkdir()
    first = start_daemon(tiny_pack, dirs[0])
    first.wait_for("READY=1")
    orphaned = ExpertClient(first.endpoint, name="orphaned", timeout_s=5)
    shm = Path("/dev/shm") / orphaned.welcome.shm
    rival = start_daemon(tiny_pack, dirs[1], "--endpoint", first.endpoint)  # the flag given last wins
    rival.proc.wait(timeout=30)
    code, err = rival.stop()
    assert code != 0 and "another expertd is serving" in err
    assert first.proc.poll() is None, "the rival disturbed the running daemon"

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    first.notify.close()
    assert first.socket_path.exists()  # what SIGKILL leaves behind, with its staging segment (below)
    second = start_daemon(tiny_pack, dirs[2], "--endpoint", first.endpoint)
    second.wait_for("READY=1")
    assert not shm.exists()
    with pytest.raises(DaemonUnavailable, match="no longer knows this client"):
        list(orphaned.fetch([(0, 1)]))  # its socket reconnected to the new daemon, its session did not
    orphaned.close()
    with ExpertClient(first.endpoint) as client:
        for expert in client.fetch([(0, 3)]):
            assert expert.key == (0, 3)
            expert.release()
    code, err = second.stop()
    assert code == 0, err
    # The dead daemon's staging is gone, removed by this daemon or by another test's started meanwhile
    # (make test runs tests side by side; every expertd clears dead daemons' staging at start).
    assert "left by an expertd that is gone" in err


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
            for e in (10, 15):  # issue 37: a FAIL that says what is wrong, not a retryable I/O error
                with pytest.raises(FetchFailed) as caught:
                    list(client.fetch([(last.layer, e)]))
                assert caught.value.code is p.FailCode.TRUNCATED, caught.value
                size = last.block_offset(10) + 4096
                assert (f"is {size:,} bytes now, its manifest says {m.pack_size_bytes:,}" in caught.value.message
                        and f"layer {last.layer} expert {e}" in caught.value.message
                        and "expertpack verify" in caught.value.message), caught.value.message
            stats = client.stats()
        assert stats["counters"]["io_errors"] >= 2 and stats["counters"]["failed"] == 2
        assert stats["slots"]["reading"] == 0 and stats["slots"]["leased"] == 0
    finally:
        assert d.stop()[0] == 0


CHURN_SCRIPT = """
import sys, zmq
from expertpack.client import protocol as p
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "churn")))
assert isinstance(p.decode(sock.recv()), p.Welcome)
keys = tuple(p.ExpertKey(l, e) for l in range(4) for e in range(16))
sock.send(p.encode(p.Fetch(1, keys[:8])))          # fills its 8 slots
sock.send(p.encode(p.Fetch(2, keys[8:])))          # waits for slots
sock.send(p.encode(p.Cancel(1)))                   # in-flight reads end as CANCELLED
sock.close(0)                                      # and the client is gone before they do
"""


def test_clients_vanishing_with_cancelled_reads_in_flight(daemon: Daemon) -> None:
    """Dozens of clients that fetch, cancel and vanish before the cancelled reads complete: no slot
    is ever handed out twice, the daemon survives, every lease comes back."""
    for _ in range(40):
        subprocess.run([sys.executable, "-c", CHURN_SCRIPT, daemon.endpoint], check=True, timeout=30)
    stats = wait_stats(daemon.endpoint, lambda s: s["slots"]["unleased"] == 48 - 8 and not s["slots"]["reading"])
    assert daemon.proc.poll() is None, daemon.log
    assert stats["slots"]["unleased"] == 48 - 8 and stats["slots"]["reading"] == 0
    assert [c["name"] for c in stats["clients"]] == ["observer"]
    assert "Traceback" not in daemon.log


def test_repeated_fetch_and_cancel_keeps_queues_bounded(daemon: Daemon) -> None:
    import zmq

    keys = tuple(p.ExpertKey(l, e) for l in range(4) for e in range(16))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "canceller")))
        assert sock.poll(10000) and isinstance(p.decode(sock.recv()), p.Welcome)
        sock.send(p.encode(p.Fetch(1, keys[:8])))  # holds all 8 slots: later keys can only queue
        big = keys * 1024  # 65,536 keys, the protocol's maximum
        for i in range(2, 12):
            sock.send(p.encode(p.Fetch(i, big)))
            sock.send(p.encode(p.Cancel(i)))
            # Read the answers as a client must: one unread request of 65,536 FAILs fits the
            # daemon's send queue, ten do not (it would drop the client as not reading).
            answered = 0
            while answered < len(big):
                assert sock.poll(30000), f"request {i}: {answered} of {len(big)} keys answered"
                msg = p.decode(sock.recv())
                answered += isinstance(msg, p.Fail) and msg.id == i
        sock.send(p.encode(p.Stats()))
        deadline = time.monotonic() + 60
        while True:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no STATS reply"
            msg = p.decode(sock.recv())
            if isinstance(msg, p.StatsReply):
                break
        me = next(c for c in msg.stats["clients"] if c["name"] == "canceller")
        assert me["queued"] == 0 and me["queue_entries"] == 0 and me["requests"] <= 1
        assert msg.stats["counters"]["cancelled"] == 10 * len(big)


def test_tcp_needs_curve_and_works_with_it(tiny_pack: Path, tmp_path: Path) -> None:
    import socket as pysocket

    import zmq.auth

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "expertd")
    server_public, _ = zmq.auth.load_certificate(public_file)
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(tiny_pack, tmp_path, "--endpoint", f"tcp://127.0.0.1:{port}",
                     "--curve-secret-key-file", secret_file)
    d.endpoint = f"tcp://127.0.0.1:{port}"  # the flag given last wins over start_daemon's ipc endpoint
    d.wait_for("READY=1")
    try:
        with pytest.raises(Exception, match="refuses plain TCP"):
            ExpertClient(d.endpoint)
        with ExpertClient(d.endpoint, curve_server_key=server_public, timeout_s=10) as client:
            m = Manifest.load(tiny_pack)
            for expert in client.fetch([(0, 3)]):
                assert hashlib.sha256(expert.data).hexdigest() == m.layer(0).sha256[3]
                expert.release()
        wrong_public, _ = zmq.curve_keypair()
        with pytest.raises(DaemonUnavailable):  # the handshake never completes: no answer
            ExpertClient(d.endpoint, curve_server_key=wrong_public, timeout_s=1)
    finally:
        assert d.stop()[0] == 0


def test_clean_client_exits_are_not_protocol_errors(daemon: Daemon) -> None:
    """A client that fetches, releases and closes leaves its last RELEASE behind its disconnect;
    the daemon sees the disconnect first. That is a clean close, not an error."""
    for i in range(200):
        with ExpertClient(daemon.endpoint, name=f"clean{i}") as client:
            for expert in client.fetch([(i % 4, i % 16), ((i + 1) % 4, (i + 5) % 16)]):
                expert.release()
    stats = wait_stats(daemon.endpoint, lambda s: s["slots"]["unleased"] == 48 - 8)
    assert stats["counters"]["clients_total"] == 201
    assert stats["counters"]["protocol_errors"] == 0, stats["counters"]
    assert stats["slots"]["unleased"] == 48 - 8 and stats["slots"]["leased"] == 0


def test_a_second_expertd_on_a_starting_ones_endpoint_says_so(tiny_pack: Path, tmp_path: Path) -> None:
    """Two daemons started at once on one endpoint: the one that loses the race says another
    expertd is there (never an errno, never the winner's socket removed); a lock the daemon made
    goes at exit."""
    import fcntl
    import os

    lock = tmp_path / "expertd.sock.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # an expertd between its checks and its bind
    try:
        loser = subprocess.run([str(Path(sys.executable).parent / "expertd"), "--pack", str(tiny_pack), "--endpoint",
                                f"ipc://{tmp_path}/expertd.sock"], capture_output=True, text=True, timeout=30)
    finally:
        lock.unlink()  # as that expertd would at its exit
        os.close(fd)
    assert loser.returncode == 2 and "Traceback" not in loser.stderr and "Errno" not in loser.stderr, loser.stderr
    assert "another expertd is serving (or starting)" in loser.stderr and str(lock) in loser.stderr
    d = start_daemon(tiny_pack, tmp_path)  # the lock is free now: a daemon starts, and cleans up after itself
    d.wait_for("READY=1")
    assert lock.exists()
    assert d.stop()[0] == 0
    assert not lock.exists() and not d.socket_path.exists()


def test_a_lock_file_that_was_there_before_is_left_at_exit(tiny_pack: Path, tmp_path: Path) -> None:
    """Issue 37: an empty <socket>.lock that was there before expertd started (an operator's, or
    one a killed expertd left) was deleted at exit. expertd uses it, and removes only what it made."""
    lock = tmp_path / "expertd.sock.lock"
    lock.touch()
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    code, err = d.stop()
    assert code == 0, err
    assert lock.exists() and lock.stat().st_size == 0, "a lock file expertd did not make was removed"
    assert not d.socket_path.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
def test_sigterm_while_the_staging_is_being_locked_leaves_nothing(tiny_pack: Path, tmp_path: Path,
                                                                  sig: signal.Signals) -> None:
    """Locking gigabytes of staging takes seconds; strace stretches mlock to 3 s here so that the
    signal lands inside it. The segment goes with the daemon, which exits 0. SIGHUP and SIGUSR1
    (issue 37: their default action left a 1.77 GB segment behind) stop it as SIGTERM does."""
    import os

    import psutil

    if shutil.which("strace") is None:
        pytest.skip("strace (to stretch mlock) is not installed")
    argv = ["strace", "-f", "-o", "/dev/null", "-e", "trace=mlock", "-e", "inject=mlock:delay_exit=3000000",
            str(Path(sys.executable).parent / "expertd"), "--pack", str(tiny_pack), "--endpoint",
            f"ipc://{tmp_path}/expertd.sock", "--stage-slots", "8", "--client-slots", "1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30

    def own_segments() -> set[str]:
        """The segments of strace's children (expertpack-PID-...), not those of other tests' daemons."""
        pids = {child.pid for child in psutil.Process(proc.pid).children(recursive=True)}
        return {n for n in os.listdir("/dev/shm") if n.startswith("expertpack-") and int(n.split("-")[1]) in pids}

    while not (new := own_segments()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no segment"
        time.sleep(0.01)
    (segment,) = new
    os.kill(int(segment.split("-")[1]), sig)  # the daemon (strace's child), inside its mlock
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert f"interrupted during start-up ({sig.name})" in err
    assert not (Path("/dev/shm") / segment).exists(), "the staging segment outlived the daemon"
    assert not (tmp_path / "expertd.sock").exists()


def test_a_dead_daemons_staging_is_removed_at_start_a_live_ones_is_not(tiny_pack: Path, tmp_path: Path) -> None:
    import os

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone
    shm = Path("/dev/shm")
    mine = [shm / f"expertpack-{dead.pid}-deadbeef", shm / f"expertpack-{os.getpid()}-0a11ce00"]
    for path in mine:
        path.write_bytes(b"x" * 4096)
    try:
        d = start_daemon(tiny_pack, tmp_path)
        d.wait_for("READY=1")
        code, log = d.stop()
        assert code == 0, log
        # Removed (and logged: "removed PATH") by this daemon, or by another test's started in between:
        # make test runs tests side by side, and every expertd clears dead daemons' staging at start.
        assert not mine[0].exists()
        assert mine[1].exists(), "the staging of a live process was removed"
    finally:
        for path in mine:
            path.unlink(missing_ok=True)
