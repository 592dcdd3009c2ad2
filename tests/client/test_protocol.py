"""The protocol on the wire: golden bytes (a change to them is a protocol change), a round trip for
every message, and decode's refusals, each with the code a peer will see."""

from __future__ import annotations

import msgpack
import pytest

from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey

FP = "ab" * 32

EXAMPLES: list[p.Message] = [
    p.Hello(1, "worker-0"),
    p.Welcome(1, FP, {"arch": "qwen3moe", "n_layer": 2}, "expertpack-1-abcd", 1 << 20, 1 << 16, (0, 1, 2)),
    p.Welcome(3, FP, {"arch": "qwen3moe", "n_layer": 2}, "expertpack-1-abcd", 1 << 20, 1 << 16, (0, 1), 4, 12),
    p.Fetch(7, (ExpertKey(1, 2), ExpertKey(3, 4)), p.Priority.PREFETCH),
    p.Ready(7, ExpertKey(1, 2), 5, 110592),
    p.Fail(7, ExpertKey(3, 4), p.FailCode.IO_ERROR, "short read"),
    p.Fail(7, ExpertKey(3, 4), p.FailCode.CORRUPT, "crc32 mismatch"),
    p.Fail(7, ExpertKey(3, 4), p.FailCode.TRUNCATED, "experts.pack is 4096 bytes now"),
    p.Release((5, 6)),
    p.Cancel(7),
    p.Stats(),
    p.StatsReply({"counters": {"ready": 1}}),
    p.Ping(),
    p.Pong(),
    p.Error(p.ErrorCode.BAD_FIELD, "nope"),
    p.Bye("shutting down"),
    p.Heartbeat(),
    p.Promote(7),
    p.Keep((4, 4, 9)),
    p.Condemned((12,)),
    p.Welcome(4, FP, {"arch": "qwen3moe"}, "expertpack-1-abcd", 1 << 20, 1 << 16, (0, 1), 4, 12, 1000, 10_000),
]


def test_golden_bytes() -> None:
    assert p.encode(p.Fetch(7, (ExpertKey(1, 2), ExpertKey(3, 4)), p.Priority.PREFETCH)).hex() == (
        "84" "a26f70" "03" "a26964" "07" "a46b657973" "92" "920102" "920304" "a47072696f" "01")
    assert p.encode(p.Ready(7, ExpertKey(1, 2), 5, 110592)).hex() == (
        "85" "a26f70" "04" "a26964" "07" "a36b6579" "920102" "a4736c6f74" "05" "a66e6279746573" "ce0001b000")
    assert p.encode(p.Ping()).hex() == "81a26f700a"


def test_version_2_adds_fail_corrupt() -> None:
    """v2's one change: FAIL code CORRUPT (4)."""
    assert p.encode(p.Fail(7, ExpertKey(3, 4), p.FailCode.CORRUPT, "crc")).hex() == (
        "85" "a26f70" "05" "a26964" "07" "a36b6579" "920304" "a4636f6465" "04" "a76d657373616765" "a3637263")
    assert p.decode(bytes.fromhex("85a26f7005a2696407a36b6579920304a4636f646504a76d657373616765a3637263")) == \
        p.Fail(7, ExpertKey(3, 4), p.FailCode.CORRUPT, "crc")


def test_version_3_adds_the_ram_tier_to_welcome() -> None:
    """v3: WELCOME names the RAM tier's slots (READY may name one); HELLO carries the version the
    daemon checks. A WELCOME without the new fields (no RAM tier) still decodes, as 0 and 0."""
    assert p.encode(p.Hello(3, "w")).hex() == (
        "84" "a26f70" "01" "a776657273696f6e" "03" "a6636c69656e74" "a177" "ab66696e6765727072696e74" "a0")
    welcome = p.Welcome(3, FP, {}, "s", 8192, 4096, (0,), 2, 5)
    wire = msgpack.unpackb(p.encode(welcome))
    assert wire["ram_first_slot"] == 2 and wire["ram_slots"] == 5
    del wire["ram_first_slot"], wire["ram_slots"]
    old = p.decode(msgpack.packb(wire))
    assert isinstance(old, p.Welcome) and (old.ram_first_slot, old.ram_slots) == (0, 0)


def test_version_4_adds_liveness() -> None:
    """v4: HEARTBEAT (op 14, no fields, no reply) and WELCOME's heartbeat interval and timeout; a
    WELCOME without them (a daemon with no liveness rule) decodes as 0 and 0."""
    assert p.encode(p.Heartbeat()).hex() == "81a26f700e"
    welcome = p.Welcome(4, FP, {}, "s", 8192, 4096, (0,), 0, 0, 1000, 10_000)
    wire = msgpack.unpackb(p.encode(welcome))
    assert wire["heartbeat_interval_ms"] == 1000 and wire["heartbeat_timeout_ms"] == 10_000
    del wire["heartbeat_interval_ms"], wire["heartbeat_timeout_ms"]
    old = p.decode(msgpack.packb(wire))
    assert isinstance(old, p.Welcome) and (old.heartbeat_interval_ms, old.heartbeat_timeout_ms) == (0, 0)
    with pytest.raises(p.ProtocolError, match="heartbeat_timeout_ms"):
        p.decode(msgpack.packb({**wire, "heartbeat_timeout_ms": -1}))


def test_version_5_adds_promote() -> None:
    """v5: PROMOTE{id} (op 15, no reply), an id as CANCEL's."""
    assert p.encode(p.Promote(7)).hex() == "82" "a26f70" "0f" "a26964" "07"
    with pytest.raises(p.ProtocolError, match="PROMOTE.id"):
        p.decode(msgpack.packb({"op": 15, "id": -1}))


def test_version_6_adds_the_ram_hold_share_to_welcome() -> None:
    """v6: WELCOME's ram_holds, the RAM tier blocks the client may hold; absent (no tier), 0."""
    welcome = p.Welcome(6, FP, {}, "s", 8192, 4096, (0,), 1, 1, 1000, 10_000, 256)
    wire = msgpack.unpackb(p.encode(welcome))
    assert wire["ram_holds"] == 256
    del wire["ram_holds"]
    old = p.decode(msgpack.packb(wire))
    assert isinstance(old, p.Welcome) and old.ram_holds == 0
    with pytest.raises(p.ProtocolError, match="ram_holds"):
        p.decode(msgpack.packb({**wire, "ram_holds": -1}))


def test_version_7_adds_fail_truncated() -> None:
    """v7's one change: FAIL code TRUNCATED (5), the pack shorter than its manifest (issue 37: it was
    an IO_ERROR, which a worker retries as if the daemon were away)."""
    assert p.encode(p.Fail(7, ExpertKey(3, 4), p.FailCode.TRUNCATED, "t")).hex() == (
        "85" "a26f70" "05" "a26964" "07" "a36b6579" "920304" "a4636f6465" "05" "a76d657373616765" "a174")
    assert p.decode(bytes.fromhex("85a26f7005a2696407a36b6579920304a4636f646505a76d657373616765a174")) == \
        p.Fail(7, ExpertKey(3, 4), p.FailCode.TRUNCATED, "t")


def test_version_8_adds_keep_and_the_keep_share() -> None:
    """v8: KEEP{slots} (op 16, no reply), slots as RELEASE's, WELCOME's ram_keeps (absent: 0), and
    CONDEMNED{slots} (op 17, unasked)."""
    assert p.PROTOCOL_VERSION == 8
    assert p.encode(p.Keep((3, 3))).hex() == "82" "a26f70" "10" "a5736c6f7473" "920303"
    assert p.encode(p.Condemned((3,))).hex() == "82" "a26f70" "11" "a5736c6f7473" "9103"
    with pytest.raises(p.ProtocolError, match="KEEP.slots"):
        p.decode(msgpack.packb({"op": 16, "slots": [-1]}))
    welcome = p.Welcome(8, FP, {}, "s", 8192, 4096, (0,), 1, 1, 1000, 10_000, 256, 100)
    wire = msgpack.unpackb(p.encode(welcome))
    assert wire["ram_keeps"] == 100
    del wire["ram_keeps"]
    old = p.decode(msgpack.packb(wire))
    assert isinstance(old, p.Welcome) and old.ram_keeps == 0


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    assert p.decode(p.encode(msg)) == msg


def test_every_op_has_a_message_and_an_example() -> None:
    assert set(p.MESSAGES) == set(p.Op)
    assert {type(m) for m in EXAMPLES} == set(p.MESSAGES.values())


def test_default_priority_is_demand() -> None:
    raw = msgpack.packb({"op": 3, "id": 1, "keys": [[0, 1]]})
    assert p.decode(raw).prio is p.Priority.DEMAND


@pytest.mark.parametrize("raw,code,text", [
    (b"\xc1", p.ErrorCode.MALFORMED, "msgpack"),
    (msgpack.packb([1, 2]), p.ErrorCode.MALFORMED, "map"),
    (msgpack.packb({"id": 1}), p.ErrorCode.MALFORMED, "op"),
    (msgpack.packb({"op": 99}), p.ErrorCode.UNKNOWN_OP, "99"),
    (msgpack.packb({"op": 3, "keys": [[0, 1]]}), p.ErrorCode.BAD_FIELD, "`id`"),
    (msgpack.packb({"op": 3, "id": -1, "keys": [[0, 1]]}), p.ErrorCode.BAD_FIELD, "FETCH.id"),
    (msgpack.packb({"op": 3, "id": 1, "keys": []}), p.ErrorCode.BAD_FIELD, "FETCH.keys"),
    (msgpack.packb({"op": 3, "id": 1, "keys": [[0, 1, 2]]}), p.ErrorCode.BAD_FIELD, "[layer, expert]"),
    (msgpack.packb({"op": 3, "id": 1, "keys": [[True, 1]]}), p.ErrorCode.BAD_FIELD, "FETCH.keys"),
    (msgpack.packb({"op": 3, "id": 1, "keys": [[0, 1]], "prio": 5}), p.ErrorCode.BAD_FIELD, "FETCH.prio"),
    (msgpack.packb({"op": 3, "id": 1.0, "keys": [[0, 1]]}), p.ErrorCode.BAD_FIELD, "FETCH.id"),
    (msgpack.packb({"op": 6, "slots": ["a"]}), p.ErrorCode.BAD_FIELD, "RELEASE.slots"),
    (msgpack.packb({"op": 1, "version": 1, "client": "x" * 5000}), p.ErrorCode.MALFORMED, "msgpack"),
    (msgpack.packb({"op": 1, "version": 1, "client": "x" * 2000}), p.ErrorCode.BAD_FIELD, "HELLO.client"),
    (msgpack.packb({"op": 2, "version": 1, "fingerprint": "zz", "model": {}, "shm": "s", "shm_bytes": 1,
                    "slot_bytes": 1, "slots": []}), p.ErrorCode.BAD_FIELD, "WELCOME.fingerprint"),
    (msgpack.packb({"op": 3, "id": 1, "keys": [[0, 0]] * (p.MAX_KEYS + 1)}), p.ErrorCode.MALFORMED, "msgpack"),
    (b"\x80" * (p.MAX_MESSAGE_BYTES + 1), p.ErrorCode.TOO_LARGE, "exceeds"),
    (msgpack.packb({"op": 3, "id": 1, "keys": msgpack.ExtType(1, b"x")}), p.ErrorCode.MALFORMED, "msgpack"),
])
def test_decode_refuses_with_a_code(raw: bytes, code: p.ErrorCode, text: str) -> None:
    with pytest.raises(p.ProtocolError) as caught:
        p.decode(raw)
    assert caught.value.code is code and text in caught.value.message


def test_unknown_extra_fields_are_ignored() -> None:
    """Forward compatibility inside a version: a newer peer may add fields."""
    raw = msgpack.packb({"op": 10, "note": "from the future"})
    assert p.decode(raw) == p.Ping()


@pytest.mark.parametrize("share, budget", [(1, 0), (2, 1), (3, 2), (8, 4), (9, 5), (256, 128)])
def test_prefetch_budget_is_half_rounded_up_and_never_the_last(share: int, budget: int) -> None:
    assert p.prefetch_budget(share) == budget
