"""Fair slots against a real expertd: a client process (a CURVE key over tcp) is leased at most
max_client_slots whatever its HELLOs ask, over all its connections, so another client still gets
slots; a HELLO with a bad field gets ERROR naming the field and changes nothing; settings that would
make the cap meaningless are refused at start."""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from expertpack.client import ExpertClient
from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey

from ..conftest import BIN, Daemon, free_port, start_daemon
from ..helpers.expertd import hello_elsewhere


@pytest.fixture
def small_daemon(tiny_pack: Path, tmp_path: Path, request: pytest.FixtureRequest):
    """expertd with 8 staging slots, 2 to a client by default; extra flags from the test's param."""
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "8", "--client-slots", "2", *getattr(request, "param", ()))
    d.wait_for("READY=1")
    yield d
    code, err = d.stop()
    assert code == 0, err


def dealer(stack: ExitStack, endpoint: str) -> zmq.Socket:
    ctx = stack.enter_context(zmq.Context())
    sock = stack.enter_context(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, fields: dict[str, Any]) -> p.Message:
    """Sends HELLO with these fields (over a valid one) and returns the answer."""
    sock.send(msgpack.packb({"op": int(p.Op.HELLO), "version": p.PROTOCOL_VERSION, "client": "t", **fields}))
    assert sock.poll(10000), "no answer"
    return p.decode(sock.recv())


def fetched(client: ExpertClient, keys: list[ExpertKey]) -> list[ExpertKey]:
    got = []
    for expert in client.fetch(keys, timeout_s=10):
        got.append(expert.key)
        expert.release()
    return got


def unleased(daemon: Daemon) -> int:
    with ExitStack() as stack:
        sock = dealer(stack, daemon.endpoint)
        sock.send(p.encode(p.Stats()))
        assert sock.poll(10000)
        reply = p.decode(sock.recv())
        assert isinstance(reply, p.StatsReply)
        return reply.stats["slots"]["unleased"]


def test_hello_carries_slots_only_when_it_asks_for_some() -> None:
    """Golden bytes: HELLO{version 2, client "w", fingerprint "", slots 4}; without slots, the field is
    left off (older daemons ignore it either way)."""
    asking = p.Hello(2, "w", "", 4)
    assert p.encode(asking).hex() == (
        "85" "a26f70" "01" "a776657273696f6e" "02" "a6636c69656e74" "a177" "ab66696e6765727072696e74" "a0"
        "a5736c6f7473" "04")
    assert p.decode(p.encode(asking)) == asking
    assert "slots" not in msgpack.unpackb(p.encode(p.Hello(2, "w")))
    assert p.decode(p.encode(p.Hello(2, "w"))).slots == 0


@pytest.mark.parametrize("small_daemon", [("--max-client-slots", "4")], indirect=True)
def test_a_client_asking_for_every_slot_gets_the_cap(small_daemon: Daemon) -> None:
    with ExitStack() as stack:
        greedy = ask(dealer(stack, small_daemon.endpoint), {"client": "greedy", "slots": 8})
        assert isinstance(greedy, p.Welcome), greedy
        assert len(greedy.slots) == 4  # asked for all 8
        other = stack.enter_context(hello_elsewhere(small_daemon.endpoint, "other", 100))
        assert isinstance(other, p.Welcome), other
        assert len(other.slots) == 4 and not set(other.slots) & set(greedy.slots)
        late = stack.enter_context(hello_elsewhere(small_daemon.endpoint, "late"))
        assert isinstance(late, p.Error) and late.code is p.ErrorCode.NO_SLOTS, late
        assert "2 slots asked, 0 of 8" in late.message
    assert "asked, at most 4 a client process" in small_daemon.log


def test_the_default_cap_is_half_the_staging_and_others_still_get_slots(small_daemon: Daemon) -> None:
    with ExitStack() as stack:
        greedy = stack.enter_context(hello_elsewhere(small_daemon.endpoint, "greedy", 1 << 20))
        assert isinstance(greedy, p.Welcome) and len(greedy.slots) == 4, greedy
        modest = stack.enter_context(hello_elsewhere(small_daemon.endpoint, "modest", 1))
        assert isinstance(modest, p.Welcome) and len(modest.slots) == 1, modest
        with ExpertClient(small_daemon.endpoint, name="worker") as client:
            assert len(client.slots) == 2  # no number asked: client_slots
            assert sorted(fetched(client, [ExpertKey(0, 0), ExpertKey(1, 3)])) == [ExpertKey(0, 0), ExpertKey(1, 3)]
            assert unleased(small_daemon) == 8 - 4 - 1 - 2


def test_the_connections_of_one_process_share_its_cap(small_daemon: Daemon) -> None:
    """Issue 37: the cap was per connection, so one process with two sockets asking for every slot
    leased all 8 and an honest client got NO_SLOTS. Now they share the process's cap (4), the
    second gets what the first left (nothing), and another process still gets its slots."""
    with ExitStack() as stack:
        first = ask(dealer(stack, small_daemon.endpoint), {"client": "greedy1", "slots": 1 << 20})
        assert isinstance(first, p.Welcome) and len(first.slots) == 4, first
        second_sock = dealer(stack, small_daemon.endpoint)
        second = ask(second_sock, {"client": "greedy2", "slots": 1 << 20})
        assert isinstance(second, p.Error) and second.code is p.ErrorCode.NO_SLOTS, second
        assert "this client process" in second.message and "4 slots over 1 session" in second.message, second
        with hello_elsewhere(small_daemon.endpoint, "honest", 2) as honest:
            assert isinstance(honest, p.Welcome) and len(honest.slots) == 2, honest
        second_sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "greedy2", slots=1)))
        assert second_sock.poll(10000)
        welcome = p.decode(second_sock.recv())
        assert isinstance(welcome, p.Error) and welcome.code is p.ErrorCode.NO_SLOTS, welcome
        stack.close()  # the process's sessions end with their connections: its share is free again
        with ExitStack() as again:
            third = ask(dealer(again, small_daemon.endpoint), {"client": "greedy3", "slots": 1 << 20})
            deadline = time.monotonic() + 10
            while isinstance(third, p.Error) and time.monotonic() < deadline:  # until the closes are seen
                time.sleep(0.05)
                third = ask(dealer(again, small_daemon.endpoint), {"client": "greedy3", "slots": 1 << 20})
            assert isinstance(third, p.Welcome) and len(third.slots) == 4, third


def test_the_connections_of_one_curve_key_share_a_cap(tiny_pack: Path, tmp_path: Path) -> None:
    """Over tcp a client is its CurveZMQ key: two connections with one key share a cap of 4 (of 8),
    a connection with another key gets slots of its own."""
    import zmq.auth

    _, secret_file = zmq.auth.create_certificates(str(tmp_path), "expertd")
    server_public, _ = zmq.auth.load_certificate(secret_file)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "8", "--client-slots", "2", "--endpoint", endpoint,
                     "--curve-secret-key-file", secret_file)
    d.wait_for("READY=1")
    try:
        with ExitStack() as stack:
            ctx = stack.enter_context(zmq.Context())

            def curve_dealer(keypair: tuple[bytes, bytes]) -> zmq.Socket:
                sock = stack.enter_context(ctx.socket(zmq.DEALER))
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, keypair[0])
                sock.setsockopt(zmq.CURVE_SECRETKEY, keypair[1])
                sock.connect(endpoint)
                return sock

            mine, other = zmq.curve_keypair(), zmq.curve_keypair()
            first = ask(curve_dealer(mine), {"client": "greedy1", "slots": 1 << 20})
            assert isinstance(first, p.Welcome) and len(first.slots) == 4, first
            second = ask(curve_dealer(mine), {"client": "greedy2", "slots": 1 << 20})
            assert isinstance(second, p.Error) and second.code is p.ErrorCode.NO_SLOTS, second
            assert "this client's CurveZMQ key" in second.message, second
            honest = ask(curve_dealer(other), {"client": "honest", "slots": 2})
            assert isinstance(honest, p.Welcome) and len(honest.slots) == 2, honest
    finally:
        code, log = d.stop()
    assert code == 0, log


BAD_HELLOS = [
    ({"client": ""}, "HELLO.client"),
    ({"client": "x" * 65}, "HELLO.client"),
    ({"client": "worker\nexpertd[1] ERROR forged"}, "HELLO.client"),
    ({"client": "evil\u202ename"}, "HELLO.client"),  # a right-to-left override
    ({"client": 7}, "HELLO.client"),
    ({"slots": -1}, "HELLO.slots"),
    ({"slots": (1 << 20) + 1}, "HELLO.slots"),
    ({"slots": "4"}, "HELLO.slots"),
    ({"slots": 2.0}, "HELLO.slots"),
    ({"slots": True}, "HELLO.slots"),
]


def test_bad_hello_fields_get_error_naming_the_field_and_the_daemon_serves_on(small_daemon: Daemon) -> None:
    with ExitStack() as stack:
        sock = dealer(stack, small_daemon.endpoint)
        for fields, named in BAD_HELLOS:
            answer = ask(sock, fields)
            assert isinstance(answer, p.Error), (fields, answer)
            assert answer.code is p.ErrorCode.BAD_FIELD and named in answer.message, (fields, answer)
        assert unleased(small_daemon) == 8  # none of them leased anything
        welcome = ask(sock, {"client": "expert-worker:Qwen3-30B-A3B pid 12", "slots": 3})
        assert isinstance(welcome, p.Welcome) and len(welcome.slots) == 3, welcome
    with ExpertClient(small_daemon.endpoint, name="after") as client:
        assert fetched(client, [ExpertKey(2, 5)]) == [ExpertKey(2, 5)]
    assert small_daemon.proc.poll() is None


@pytest.mark.parametrize("flags, says", [
    (("--stage-slots", "8", "--max-client-slots", "9"), "max_client_slots (9) cannot exceed stage_slots (8)"),
    (("--stage-slots", "8", "--client-slots", "4", "--max-client-slots", "2"),
     "client_slots (4) cannot exceed max_client_slots (2)"),
    (("--max-client-slots", "-1",), "max_client_slots: must lie in 0.."),
])
def test_settings_that_defeat_the_cap_are_refused(tiny_pack: Path, flags: tuple[str, ...], says: str) -> None:
    proc = subprocess.run([str(BIN / "expertd"), "--pack", str(tiny_pack), *flags], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_connections_of_one_process_share_its_ram_hold_share(tiny_pack: Path, tmp_path: Path) -> None:
    """Issue 37's leftover: the RAM hold share was per session, so a process pinned one share of
    the tier per connection it opened. Its sessions now share one (10 here): a second connection
    of the same process gets only what a session needs to make progress (its staging slots),
    another process a share of its own."""
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "8", "--client-slots", "2", "--ram-cache-gib", "1",
                     "--client-ram-holds", "10")
    d.wait_for("READY=1")
    try:
        with ExitStack() as stack:
            first = ask(dealer(stack, d.endpoint), {"client": "holder1", "slots": 2})
            second = ask(dealer(stack, d.endpoint), {"client": "holder2", "slots": 2})
            assert isinstance(first, p.Welcome) and isinstance(second, p.Welcome), (first, second)
            assert first.ram_holds == 10 and second.ram_holds == 2, (first.ram_holds, second.ram_holds)
            with hello_elsewhere(d.endpoint, "other", 2) as other:
                assert isinstance(other, p.Welcome) and other.ram_holds == 10, other
    finally:
        assert d.stop()[0] == 0
