"""Thousands of malformed, truncated, oversized, wrongly typed and out-of-range messages, and raw
garbage frames, from clients with and without a session: every one gets ERROR (or, for an empty
frame, counts as a disconnect), the daemon never crashes, never leaks a slot, and afterwards still
serves a well-behaved client byte-exact."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import msgpack
import zmq

from expertpack.client import ExpertClient
from expertpack.client import protocol as p
from expertpack.packtools.layout import Manifest

from ..conftest import Daemon

VALID = [
    {"op": 1, "version": 1, "client": "x"},
    {"op": 3, "id": 1, "keys": [[0, 0], [1, 2]], "prio": 0},
    {"op": 6, "slots": [0]},
    {"op": 7, "id": 1},
    {"op": 8},
    {"op": 10},
]
HOSTILE_VALUES = [None, True, -1, 2**63, 2**64 - 1, 1.5, "", "x" * 5000, b"\x00" * 10, [], [[]], [[0]], [[0, 0, 0]],
                  [[-1, 0]], [["a", "b"]], {}, {"a": 1}, [0] * 70000, 1 << 40]


def hostile_messages(rng: random.Random, n: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(n):
        kind = i % 9
        base = dict(rng.choice(VALID))
        if kind == 0:  # raw garbage
            out.append(rng.randbytes(rng.randint(1, 300)))
        elif kind == 1:  # a valid message cut short
            raw = msgpack.packb(base)
            out.append(raw[:rng.randint(1, max(1, len(raw) - 1))])
        elif kind == 2:  # a field with a hostile value
            key = rng.choice([k for k in base if k != "op"] or ["op"])
            base[key] = rng.choice(HOSTILE_VALUES)
            out.append(msgpack.packb(base, use_bin_type=True))
        elif kind == 3:  # unknown or mistyped op
            base["op"] = rng.choice([0, 2, 4, 5, 9, 11, 12, 13, 14, 99, -3, "FETCH", None, 1.0])
            out.append(msgpack.packb(base, use_bin_type=True))
        elif kind == 4:  # a field missing
            key = rng.choice([k for k in base if k != "op"] or ["op"])
            base.pop(key)
            out.append(msgpack.packb(base, use_bin_type=True))
        elif kind == 5:  # not a map
            out.append(msgpack.packb(rng.choice([[1, 2, 3], "hello", 42, None, [base]]), use_bin_type=True))
        elif kind == 6:  # out-of-range keys and slots
            out.append(msgpack.packb(rng.choice([
                {"op": 3, "id": rng.randint(0, 99), "keys": [[rng.randint(0, 10**6), rng.randint(0, 10**6)]]},
                {"op": 3, "id": 5, "keys": [[0, 0]] * 70000},
                {"op": 6, "slots": [rng.randint(0, 10**6)]},
                {"op": 6, "slots": [0, 0]},
                {"op": 1, "version": 999, "client": "future"},
            ]), use_bin_type=True))
        elif kind == 7:  # oversized
            out.append(b"\x81\xa2op" + b"\x00" * (p.MAX_MESSAGE_BYTES + 10))
        else:  # msgpack extension types and deep nesting
            out.append(rng.choice([b"\xd4\x01\x00", b"\x91" * 500 + b"\x00", b"\xc1", b"\xdf\xff\xff\xff\xff"]))
    return out


def blast(endpoint: str, messages: list[bytes], hello: bool) -> tuple[int, list[p.Message]]:
    """Sends everything, then PING, reading replies all along (a peer that never reads gets its
    replies dropped at the high-water mark, which is fine for the daemon but not for this count)."""
    replies: list[p.Message] = []
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        if hello:
            sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "fuzzer")))
            assert sock.poll(10000)
            assert isinstance(p.decode(sock.recv()), p.Welcome)

        def drain() -> bool:
            while sock.poll(0):
                msg = p.decode(sock.recv())
                if isinstance(msg, p.Pong):
                    return True
                replies.append(msg)
            return False

        for raw in messages:
            sock.send(raw)
            drain()
        sock.send(p.encode(p.Ping()))  # the last answer: everything before it has been handled
        deadline = time.monotonic() + 30
        while not drain():
            assert time.monotonic() < deadline, f"the daemon stopped answering after {len(replies)} replies"
            sock.poll(100)
    return len(messages), replies


def test_fuzz_never_crashes_never_leaks_and_keeps_serving(daemon: Daemon, tiny_pack: Path) -> None:
    rng = random.Random(1234)
    total_sent = 0
    for hello in (False, True, False, True):
        sent, replies = blast(daemon.endpoint, hostile_messages(rng, 1500), hello)
        total_sent += sent
        assert daemon.proc.poll() is None, "expertd died"
        kinds = {type(r).__name__ for r in replies}
        assert kinds <= {"Error", "Welcome", "Ready", "Fail", "StatsReply", "Pong"}, kinds
        assert sum(isinstance(r, p.Error) for r in replies) > sent // 2
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint, name="after") as client:
        for expert in client.fetch([(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]):
            assert hashlib.sha256(expert.data).hexdigest() == m.layer(expert.key.layer).sha256[expert.key.expert]
            expert.release()
        stats = client.stats()
        deadline = time.monotonic() + 10
        while stats["slots"]["unleased"] != stats["slots"]["total"] - 8 and time.monotonic() < deadline:
            time.sleep(0.05)  # the fuzzers' disconnects may still be on their way
            stats = client.stats()
    # Every fuzzing session is gone and gave its slots back; only `after` still holds its lease.
    assert stats["slots"]["unleased"] == stats["slots"]["total"] - 8
    assert [c["name"] for c in stats["clients"]] == ["after"]
    assert stats["counters"]["protocol_errors"] > total_sent // 2


def test_a_message_of_several_frames_is_refused(daemon: Daemon) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    sock.send_multipart([p.encode(p.Ping()), b"extra"])
    assert sock.poll(10000)
    reply = p.decode(sock.recv())
    assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.MALFORMED
    sock.close()
    ctx.term()


def test_reconnects_with_a_routing_id_in_use_keep_memory_flat_and_steal_nothing(daemon: Daemon) -> None:
    """10,000 connections that reuse the routing id of a live client (libzmq kept ~20 kB per such
    ignored connection: +200 MB here). The daemon's RSS stays flat, a connection that takes the id
    over never inherits the session it displaced, and every slot comes back."""
    import psutil

    def dealer(ctx: zmq.Context) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, b"reused")
        s.setsockopt(zmq.LINGER, 0)
        return s

    rss = psutil.Process(daemon.proc.pid).memory_info().rss
    ctx = zmq.Context()
    try:
        victim = dealer(ctx)
        victim.connect(daemon.endpoint)
        victim.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "victim")))
        assert victim.poll(10000) and isinstance(p.decode(victim.recv()), p.Welcome)
        for _ in range(10_000):
            s = dealer(ctx)
            handshake = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            s.connect(daemon.endpoint)
            assert handshake.poll(10000), "no ZMTP handshake"  # the daemon has seen the routing id
            s.disable_monitor()
            handshake.close(0)
            s.close(0)
        with ExpertClient(daemon.endpoint, name="observer") as client:
            client.stats()  # the daemon has handled everything before this
        grown = psutil.Process(daemon.proc.pid).memory_info().rss - rss
        assert grown < 16 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 10,000 reconnects"

        thief = dealer(ctx)
        thief.connect(daemon.endpoint)
        thief.send(p.encode(p.Fetch(1, (p.ExpertKey(0, 0),))))  # in the victim's name, without a HELLO
        assert thief.poll(10000)
        reply = p.decode(thief.recv())
        assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.NO_SESSION, reply
        thief.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "thief")))  # it may have a session of its own
        assert thief.poll(10000) and isinstance(p.decode(thief.recv()), p.Welcome)
        thief.close(0)
        victim.close(0)
    finally:
        ctx.destroy(linger=0)  # closes what a failed assertion left open; term() alone would hang
    stats = None
    with ExpertClient(daemon.endpoint, name="after") as client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = client.stats()
            if stats["slots"]["unleased"] == stats["slots"]["total"] - 8:
                break
            time.sleep(0.05)
    assert stats["slots"]["unleased"] == stats["slots"]["total"] - 8 and stats["slots"]["leased"] == 0
    assert [c["name"] for c in stats["clients"]] == ["after"]
