"""Speaking to a real expertd the way the daemon, client and reliability tests do: its keys, a raw
protocol session, a HELLO from another process, its STATS awaited, a block damaged on disk, a
daemon with a RAM tier."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import zmq

from expertpack.client import ExpertClient
from expertpack.client import protocol as p
from expertpack.packtools.layout import PACK_FILE, ExpertKey, Manifest

from ..conftest import Daemon, start_daemon


def all_keys(m: Manifest) -> list[ExpertKey]:
    return [ExpertKey(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]


@contextmanager
def raw_session(endpoint: str) -> Iterator[tuple[zmq.Socket, p.Welcome]]:
    """A DEALER that said HELLO, closed (with its context) whatever the test does."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "raw")))
        assert sock.poll(10000)
        welcome = p.decode(sock.recv())
        assert isinstance(welcome, p.Welcome)
        yield sock, welcome


HELLO_SCRIPT = """
import sys, zmq
from expertpack.client import protocol as p
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, sys.argv[2], slots=int(sys.argv[3]))))
print(sock.recv().hex(), flush=True)
sys.stdin.read()  # the session lasts until the test closes stdin
"""


@contextmanager
def hello_elsewhere(endpoint: str, name: str, slots: int = 0) -> Iterator[p.Message]:
    """HELLO from a process of its own (expertd caps staging slots per client process), connected
    until the block ends; yields expertd's answer."""
    proc = subprocess.Popen([sys.executable, "-c", HELLO_SCRIPT, endpoint, name, str(slots)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield p.decode(bytes.fromhex(proc.stdout.readline().strip()))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def recv(sock: zmq.Socket) -> p.Message:
    assert sock.poll(10000), "no answer"
    return p.decode(sock.recv())


def wait_stats(endpoint: str, pred, timeout: float = 10) -> dict:
    with ExpertClient(endpoint, name="observer") as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            if pred(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def slots_back(client: ExpertClient) -> bool:
    """Whether expertd counts every slot of this client free (a PING first: it has handled what
    the client sent before it)."""
    client.ping()
    (session,) = [s for s in client.stats()["clients"] if s["slots"] == len(client.slots)]
    return session["free"] == session["slots"] and session["requests"] == 0


def flip_byte(pack: Path, key: ExpertKey, at_byte: int | None = None) -> None:
    """Flips one bit of one byte of `key`'s payload in experts.pack (by default, its middle one)."""
    layer = Manifest.load(pack).layer(key.layer)
    at = layer.block_offset(key.expert) + (layer.payload_bytes // 2 if at_byte is None else at_byte)
    with open(pack / PACK_FILE, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))



def alter_in_memory(welcome: p.Welcome, blocks: list[tuple[int, int]]) -> None:
    """Flips a bit of the middle byte of each (segment slot, payload bytes) block in expertd's
    shared segment, opened writable as a process of expertd's user may (clients map it read-only)."""
    fd = os.open(Path("/dev/shm") / welcome.shm, os.O_RDWR)
    try:
        with mmap.mmap(fd, welcome.shm_bytes) as writable:
            for slot, payload_bytes in blocks:
                writable[slot * welcome.slot_bytes + payload_bytes // 2] ^= 0x10
    finally:
        os.close(fd)

@contextmanager
def ram_daemon(pack: Path, tmp: Path, *extra: str) -> Iterator[Daemon]:
    d = start_daemon(pack, tmp, "--stage-slots", "32", "--client-slots", "8", *extra)
    d.wait_for("READY=1")
    try:
        yield d
    finally:
        code, log = d.stop()
        assert code == 0, log
