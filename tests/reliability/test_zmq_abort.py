"""Peers that flood and vanish cannot abort expertd. libzmq 4.3.5 (pyzmq's bundled copy) asserts
`!_io_error (src/stream_engine_base.cpp:310)` (libzmq issue 4841) when it writes to a connection
whose peer closed while the daemon's receive pipe from it was stopped: its own ZMTP heartbeat
timer, or a ZMTP PING of the peer decoded as the stopped pipe drains, calls out_event() on an
engine whose input already failed. expertd therefore sends no ZMTP heartbeats and never stops a
connection's receive pipe (RCVHWM 0); these reproduced the abort every time before that.
Each test also checks that every flooding connection is closed in the daemon afterwards (its fd
gone), so that surviving does not come from engines left half-alive."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from expertpack.client import ExpertClient
from expertpack.client import protocol as p

from ..conftest import Daemon, start_daemon

N_FLOODERS = 8
N_PINGS = 20_000  # twice the receive high-water mark the daemon had, never reading a PONG


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _check_alive_and_clean(d: Daemon, fds_before: int, may_stay_open: int = 0) -> None:
    deadline = time.monotonic() + 60
    while d.proc.poll() is None and _fds(d.proc.pid) > fds_before + may_stay_open and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.proc.poll() is None, d.log[-2000:]
    left = _fds(d.proc.pid) - fds_before
    assert left <= may_stay_open, f"{left} connections left open in the daemon (at most {may_stay_open} expected)"
    with ExpertClient(d.endpoint, name="after", timeout_s=10) as client:
        client.ping()
        stats = client.stats()
    assert [c["name"] for c in stats["clients"]] == ["after"]
    assert stats["slots"]["unleased"] == stats["slots"]["total"] - len(client.slots)


def _cleanup(d: Daemon) -> None:
    if d.proc.poll() is None:
        code, log = d.stop()
        assert code == 0, log[-2000:]
    else:  # SIGABRT: nothing of the daemon's own clean-up ran
        d.notify.close()
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"expertpack-{d.proc.pid}-"):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("peer_heartbeat_ms", [0, 1], ids=["plain", "zmtp-pings-among-messages"])
def test_clients_that_flood_and_vanish_do_not_abort_expertd(tiny_pack: Path, tmp_path: Path,
                                                            peer_heartbeat_ms: int) -> None:
    """peer_heartbeat_ms 1: a hostile peer's ZMTP PINGs every millisecond lie among its messages,
    so one is in the daemon's read buffer when the pipe stops (the second way to the abort)."""
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    fds_before = _fds(d.proc.pid)
    ctx = zmq.Context()
    try:
        socks = []
        for _ in range(N_FLOODERS):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            if peer_heartbeat_ms:
                s.setsockopt(zmq.HEARTBEAT_IVL, peer_heartbeat_ms)
                s.setsockopt(zmq.HEARTBEAT_TTL, 10_000)
            s.connect(d.endpoint)
            socks.append(s)
        ping = p.encode(p.Ping())
        for s in socks:
            for _ in range(N_PINGS):
                s.send(ping)
        for s in socks:
            # Closed once its last PING is written to the kernel, bounded so that a daemon gone
            # cannot hang the context's termination.
            s.close(linger=5000)
        time.sleep(3)  # heartbeats (1 s, when the daemon had them) came due while it drained the pipes
        _check_alive_and_clean(d, fds_before)
    finally:
        ctx.destroy(linger=0)
        _cleanup(d)


N_ROUNDS = 20


@pytest.mark.parametrize("sends_after", [0, 2000], ids=["closes", "sends-then-closes"])
def test_peers_that_take_each_others_routing_id_and_vanish_do_not_abort_expertd(tiny_pack: Path, tmp_path: Path,
                                                                                 sends_after: int) -> None:
    """The other way to a stopped pipe: a connection whose routing id another one took over
    (ROUTER_HANDOVER) has no pipe left, so whatever it sends next stops its input for good; it
    then closes. soak.py --shared-ids aborted the daemon so in 11-45 s. Such a connection stayed
    open in libzmq (nothing of it ever ran again) until the daemon exited, one fd each (20 here);
    now the daemon shuts it down itself when the new connection's first message shows the
    takeover, and none is left."""
    d = start_daemon(tiny_pack, tmp_path)
    d.wait_for("READY=1")
    fds_before = _fds(d.proc.pid)
    ctx = zmq.Context()
    ping = p.encode(p.Ping())
    try:
        for round_ in range(N_ROUNDS):
            old = ctx.socket(zmq.DEALER)
            old.setsockopt(zmq.ROUTING_ID, b"shared-%d" % (round_ % 2))
            old.setsockopt(zmq.HEARTBEAT_IVL, 1)
            old.setsockopt(zmq.HEARTBEAT_TTL, 10_000)
            # Its own timeout for the daemon's answer to a ZMTP PING defaults to the interval: on a
            # loaded machine it dropped the connection, and the PONG with it (7 of 100 first pings
            # of a fresh daemon beside two busy loops on 2 cores; none at 10 s).
            old.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
            old.connect(d.endpoint)
            old.send(ping)
            assert old.poll(10_000), "no PONG"
            old.recv()
            new = ctx.socket(zmq.DEALER)
            new.setsockopt(zmq.ROUTING_ID, b"shared-%d" % (round_ % 2))
            new.connect(d.endpoint)
            new.send(ping)
            assert new.poll(10_000), "no PONG on the connection that took the routing id"
            new.recv()
            for _ in range(sends_after):  # no pipe for these in the daemon: they fill this side's queue
                try:
                    old.send(ping, zmq.NOBLOCK)
                except zmq.Again:  # the queue is full (the high-water mark): blocking would never return
                    break
            time.sleep(0.05)
            old.close(linger=0)
            new.close(linger=0)
        time.sleep(3)
        _check_alive_and_clean(d, fds_before, may_stay_open=0)
    finally:
        ctx.destroy(linger=0)
        _cleanup(d)
