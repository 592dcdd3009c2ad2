"""A disconnect ends the session of the connection that closed, whatever was read after it: messages
a closed connection left in the daemon's queue carry its fd, which a new connection may already
have (the kernel hands out the lowest free fd); such a late message must not make the new
connection's disconnect end someone else's session and leave its own, and its slots, alive.
Found by scripts/soak.py (fuzzers and churning clients at once leaked 2-109 slots in 25 s)."""

from __future__ import annotations

import time

import zmq

from expertpack.client import protocol as p

from ..conftest import Daemon
from ..helpers.expertd import wait_stats


def test_late_messages_of_a_closed_connection_do_not_keep_a_session_alive(daemon: Daemon) -> None:
    ctx = zmq.Context()
    try:
        for round_ in range(5):
            early = ctx.socket(zmq.DEALER)
            early.setsockopt(zmq.ROUTING_ID, b"early-%d" % round_)
            early.connect(daemon.endpoint)
            ping = p.encode(p.Ping())
            for _ in range(5000):  # still being read after this connection has closed
                early.send(ping)
            early.close(linger=-1)
            time.sleep(0.05)  # its fd is closed in the daemon, free for the next connection
            victim = ctx.socket(zmq.DEALER)
            victim.setsockopt(zmq.LINGER, 0)
            victim.setsockopt(zmq.ROUTING_ID, b"victim-%d" % round_)
            victim.connect(daemon.endpoint)
            victim.send(p.encode(p.Hello(p.PROTOCOL_VERSION, f"victim{round_}")))
            deadline = time.monotonic() + 30
            while not isinstance(msg := p.decode(victim.recv()) if victim.poll(30000) else None, p.Welcome):
                assert msg is not None and time.monotonic() < deadline, "no WELCOME"
            time.sleep(0.3)  # the early connection's PINGs are read meanwhile, under the victim's fd
            victim.close(0)
    finally:
        ctx.destroy(linger=0)
    stats = wait_stats(daemon.endpoint, lambda s: [c["name"] for c in s["clients"]] == ["observer"])
    assert [c["name"] for c in stats["clients"]] == ["observer"], stats["clients"]
    assert stats["slots"]["unleased"] == stats["slots"]["total"] - 8
