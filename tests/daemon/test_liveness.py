"""Liveness (protocol v4): a client that stays connected but sends nothing, frozen (SIGSTOP) in the
middle of its traffic, or a raw peer that never heartbeats, loses its session and slots
heartbeat_timeout_s after its last message; a live client, idle or busy computing, keeps them
(ExpertClient's heartbeat thread); a frozen client that is continued gets a clear
DaemonUnavailable and a new session works. A connection that takes over a routing id and stays
silent does not keep the session it took over alive either. Real expertd, real sockets, with
short heartbeats (--heartbeat-interval-s 0.5, --heartbeat-timeout-s 3) so that the test is quick."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from expertpack.client import ExpertClient
from expertpack.client import protocol as p

from ..conftest import start_daemon
from ..helpers.expertd import wait_stats

INTERVAL_S, TIMEOUT_S = 0.5, 3.0

CLIENT_SCRIPT = """
import sys, time
from expertpack.client import ExpertClient
endpoint, name, mode = sys.argv[1:4]
c = ExpertClient(endpoint, name=name)
held = [e for e in c.fetch([(0, i) for i in range(4)])]
print("holding", flush=True)
if mode == "idle":
    time.sleep(600)
elif mode == "busy":  # computes in Python: holds the GIL, lets it go every few ms; never calls the client
    while True:
        sum(i * i for i in range(100_000))
else:  # churn: fetches and releases without a pause until stopped; then reports what the next fetch says
    i = 0
    try:
        while True:
            for e in c.fetch([(1 + i % 3, i % 16)]):
                e.release()
            i += 1
    except Exception as exc:
        print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
    c.close()
    with ExpertClient(endpoint, name=name + "-again") as again:
        for e in again.fetch([(1, 0)]):
            e.release()
    print("reconnected", flush=True)
    time.sleep(600)
"""


def test_a_client_frozen_mid_traffic_loses_its_session_and_live_ones_keep_theirs(tiny_pack: Path,
                                                                                   tmp_path: Path) -> None:
    """The frozen client's last message is a FETCH or a RELEASE, not a PING: under protocol v3
    (libzmq's ZMTP TTL, disarmed by each message) it kept its 8 slots for ever."""
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "48", "--client-slots", "8",
                     "--heartbeat-interval-s", str(INTERVAL_S), "--heartbeat-timeout-s", str(TIMEOUT_S))
    d.wait_for("READY=1")
    procs = {mode: subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, d.endpoint, mode, mode],
                                    stdout=subprocess.PIPE, text=True) for mode in ("churn", "idle", "busy")}
    try:
        assert all(proc.stdout.readline().strip() == "holding" for proc in procs.values())
        # 8 slots leased to each of the three and to the observer; each client holds 4 experts
        assert wait_stats(d.endpoint, lambda s: s["slots"]["leased"] >= 12)["slots"]["unleased"] == 48 - 32
        time.sleep(0.5)  # churning
        procs["churn"].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        time.sleep(TIMEOUT_S - 1)
        assert "churn" in [c["name"] for c in wait_stats(d.endpoint, lambda s: True)["clients"]], \
            "dropped before heartbeat_timeout_s"
        stats = wait_stats(d.endpoint, lambda s: "churn" not in [c["name"] for c in s["clients"]], timeout=TIMEOUT_S + 5)
        took_s = time.monotonic() - frozen_at
        assert sorted(c["name"] for c in stats["clients"]) == ["busy", "idle", "observer"], (took_s, stats["clients"])
        assert stats["slots"]["unleased"] == 48 - 24 and stats["slots"]["leased"] == 8, stats["slots"]
        assert stats["counters"]["clients_silent"] == 1
        assert took_s <= TIMEOUT_S + 2, f"leases back {took_s:.1f} s after the freeze"
        time.sleep(TIMEOUT_S)  # the idle and the busy client outlive the timeout twice over
        stats = wait_stats(d.endpoint, lambda s: True)
        assert sorted(c["name"] for c in stats["clients"]) == ["busy", "idle", "observer"], stats["clients"]
        assert stats["counters"]["clients_silent"] == 1

        procs["churn"].send_signal(signal.SIGCONT)
        said = procs["churn"].stdout.readline().strip()
        assert said.startswith("error DaemonUnavailable"), said
        assert "session" in said and ("sent nothing" in said or "silent for" in said), said
        assert procs["churn"].stdout.readline().strip() == "reconnected"
        assert f"client 'churn' (pid {procs['churn'].pid}) silent for" in d.log
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        code, err = d.stop()
        assert code == 0, err


def test_silent_raw_peers_lose_their_sessions_also_after_a_takeover(tiny_pack: Path, tmp_path: Path) -> None:
    """A raw DEALER that says HELLO and nothing more (no HEARTBEAT, no ZMTP PINGs) loses its slots
    after the timeout and is told why; so does a session whose routing id another connection took
    over (ROUTER_HANDOVER) when that connection stays silent: nothing of the old one arrives any
    more, and before protocol v4 it kept its slots until expertd exited."""
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "48", "--client-slots", "8",
                     "--heartbeat-interval-s", str(INTERVAL_S), "--heartbeat-timeout-s", str(TIMEOUT_S))
    d.wait_for("READY=1")
    ctx = zmq.Context()
    try:
        peers = []
        for name in (b"mute", b"taken-over"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, name)
            s.connect(d.endpoint)
            s.send(p.encode(p.Hello(p.PROTOCOL_VERSION, name.decode())))
            assert s.poll(10_000)
            welcome = p.decode(s.recv())
            assert isinstance(welcome, p.Welcome), welcome
            assert (welcome.heartbeat_interval_ms, welcome.heartbeat_timeout_ms) == (500, 3000)
            peers.append(s)
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.ROUTING_ID, b"taken-over")
        thief.connect(d.endpoint)  # takes the id over, and says nothing
        started = time.monotonic()
        stats = wait_stats(d.endpoint, lambda s: [c["name"] for c in s["clients"]] == ["observer"],
                           timeout=TIMEOUT_S + 5)
        assert [c["name"] for c in stats["clients"]] == ["observer"], stats["clients"]
        assert time.monotonic() - started <= TIMEOUT_S + 2
        assert stats["slots"]["leased"] == 0 and stats["slots"]["unleased"] == 48 - 8
        assert stats["counters"]["clients_silent"] == 2
        assert peers[0].poll(1000), "the silent client is not told"
        told = p.decode(peers[0].recv())
        assert isinstance(told, p.Error) and told.code is p.ErrorCode.NO_SESSION and "silent for" in told.message
        peers[0].send(p.encode(p.Fetch(1, ((0, 1),))))  # it wakes up and asks: refused, and told why again
        assert peers[0].poll(5000)
        refused = p.decode(peers[0].recv())
        assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.NO_SESSION, refused
        assert "session ended" in refused.message and "HELLO again" in refused.message
        peers[0].send(p.encode(p.Hello(p.PROTOCOL_VERSION, "mute")))  # and comes back
        assert peers[0].poll(5000) and isinstance(p.decode(peers[0].recv()), p.Welcome)
    finally:
        ctx.destroy(linger=0)
        code, err = d.stop()
        assert code == 0, err


def test_a_client_whose_hello_waited_for_the_daemon_keeps_its_session(tiny_pack: Path, tmp_path: Path) -> None:
    """A client made before its daemon starts: its HELLO waits in ZeroMQ's queue, longer here than
    the daemon's heartbeat timeout. The session begins at WELCOME, so the client is not taken for
    a stopped process ("was the process stopped?") at its first fetch."""
    endpoint = f"ipc://{tmp_path}/expertd.sock"
    made: list = []
    waiting = threading.Thread(target=lambda: made.append(ExpertClient(endpoint, name="early", timeout_s=60)))
    waiting.start()
    time.sleep(1.5)  # three times the heartbeat timeout below
    d = start_daemon(tiny_pack, tmp_path, "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "0.5")
    try:
        d.wait_for("READY=1")
        waiting.join(timeout=60)
        client = made[0]
        try:
            for expert in client.fetch([(0, 1)]):
                expert.release()
        finally:
            client.close()
    finally:
        code, err = d.stop()
        assert code == 0, err
