"""Who sent a message, when its connection has closed and its fd is another process's. expertd
reads without a high-water mark, so a connection's messages may still be queued when it closes;
ZMQ_SRCFD then names an fd that libzmq may have given to the next connection, and an fd -> pid
table would blame that connection's process for them (and the flood guard cut and ban it). The
pid libzmq recorded for the connection itself travels with each message."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

from expertpack.daemon.peers import peer_pid, sender_pid

SENDER = """
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 5000)  # every message delivered before the socket closes
s.connect(sys.argv[1])
for i in range(int(sys.argv[3])):
    s.send(sys.argv[2].encode())
time.sleep(float(sys.argv[4]))  # connected this long
s.close()
zmq.Context.instance().term()  # waits out LINGER: the interpreter's exit alone may drop what is queued
"""


def test_a_closed_connections_queued_messages_name_their_sender_after_its_fd_is_reused(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    endpoint = f"ipc://{tmp_path}/s.sock"
    router.bind(endpoint)
    current = None
    try:
        gone = subprocess.Popen([sys.executable, "-c", SENDER, endpoint, "late", "500", "0"])
        assert gone.wait(timeout=60) == 0
        senders: dict[bytes, set[int | None]] = {}
        fds: dict[bytes, set[int]] = {}

        def read() -> None:
            frames = router.recv_multipart(copy=False)
            senders.setdefault(frames[-1].bytes, set()).add(sender_pid(frames[-1]))
            fds.setdefault(frames[-1].bytes, set()).add(frames[-1].get(zmq.SRCFD))

        assert router.poll(30_000)
        read()  # one of the late ones: the fd its connection had
        (old_fd,) = fds[b"late"]
        deadline = time.monotonic() + 30
        while Path(f"/proc/self/fd/{old_fd}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # libzmq closes it once it has seen the disconnect: free for the next connection
        current = subprocess.Popen([sys.executable, "-c", SENDER, endpoint, "current", "1", "60"])
        deadline = time.monotonic() + 30
        while b"current" not in fds and time.monotonic() < deadline:
            if router.poll(200):  # the other late ones, read after the new connection was accepted
                read()
        assert fds[b"late"] == fds[b"current"], fds  # libzmq gave the closed connection's fd to the new one
        (fd,) = fds[b"current"]
        assert {peer_pid(fd)} == senders[b"current"] == {current.pid}  # the fd is the new connection's now
        assert senders[b"late"] == {gone.pid}  # yet the late messages name the process that sent them
    finally:
        if current is not None:
            current.kill()
            current.wait()
        ctx.destroy(0)


def test_a_tcp_message_names_no_pid() -> None:
    """Over tcp the peer is an address, not a process on this host: counted per connection."""
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hi")
        assert router.poll(10_000)
        frames = router.recv_multipart(copy=False)
        assert frames[-1].get("Peer-Address") == "127.0.0.1"
        assert sender_pid(frames[-1]) is None
    finally:
        ctx.destroy(0)
