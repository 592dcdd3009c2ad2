"""Protocol v8 between expertd and its clients: the one module that knows the wire format.

Transport: ZeroMQ, the daemon a ROUTER, each client a DEALER. Every message is ONE frame holding ONE
msgpack map with an integer `op`:

    client (DEALER) sends      [ msgpack{op, ...} ]
    daemon (ROUTER) receives   [ routing id | msgpack{op, ...} ]   and answers with the same id

    HELLO{version, client, fingerprint, slots}
                                      -> WELCOME{version, fingerprint, model, shm, shm_bytes, slot_bytes, slots,
                                                         ram_first_slot, ram_slots, ram_holds, ram_keeps,
                                                         heartbeat_interval_ms, heartbeat_timeout_ms}
                                         (ERROR FINGERPRINT when the client's trunk was built with another pack;
                                         an empty fingerprint, as ops tools send, skips the check;
                                         `client` is 1..64 printable characters; `slots` asks for that
                                         many staging slots, granted up to the daemon's max_client_slots
                                         less what the client's other sessions lease (a client is its
                                         process over ipc, its CurveZMQ key over tcp; ERROR NO_SLOTS
                                         when that leaves none), 0 or absent: its client_slots)
    FETCH{id, keys: [[layer, expert], ...], prio}
                                      -> one READY{id, key, slot, nbytes} or FAIL{id, key, code, message}
                                         per key, in completion order; `slot` is one of the client's
                                         leased slots, or (v3) a RAM tier slot
    RELEASE{slots: [slot, ...]}       (no reply; leased slots return to the client's free pool; each
                                         listing of a RAM tier slot ends one hold on it)
    KEEP{slots: [slot, ...]}          (v8; no reply: each listing of a RAM tier slot makes one of the client's
                                         holds on it a kept hold, see below)
    CANCEL{id}                        -> FAIL{code=CANCELLED} for each key of id not yet READY
    PROMOTE{id}                       (v5; no reply: the keys of FETCH id not yet answered are needed
                                         now, and go at DEMAND priority, queued or already being read)
    STATS                             -> STATS_REPLY{stats}
    PING                              -> PONG
    HEARTBEAT                         (v4; no reply: says only that the client is alive)
    anything malformed or unknown     -> ERROR{code, message}; nothing else changes
    daemon shutting down              -> BYE{reason} to every client
    a kept block fails the scrub      -> CONDEMNED{slots} to every client keeping it (v8, unasked): read
                                         it no more and RELEASE it; the key is read again at its next FETCH
                                         (a KEEP of a block that failed it already is answered so at once)
    session silent too long           -> ERROR{code=NO_SESSION, message: why} (v4, unasked)

Liveness (v4): a client holding a session sends a message, HEARTBEAT when it has nothing else to
say, at least every `heartbeat_interval_ms` that WELCOME names; the daemon ends a session it has
heard nothing from for `heartbeat_timeout_ms` (its leases and holds return to the pool) and says
so with an unasked ERROR NO_SESSION, which the client reads when it runs again (a frozen process).

Expert bytes never travel in a message: READY names a slot of the shared staging segment, and the
payload is its first `nbytes` bytes (slot i starts at byte i * slot_bytes, whichever kind it is).
RAM tier slots, [ram_first_slot, ram_first_slot + ram_slots), hold blocks resident for every
client: a READY naming one is a hold that keeps the block there (never evicted nor overwritten)
until the client RELEASEs it; several READYs, of one client or of many, may name the same RAM slot
at once, and a client releases it once per READY. Clients map the segment read-only (it is mode
0640): only expertd writes it, and it scrubs resident blocks against their crc32 in the background.
A kept hold (v8) is a hold the client means to keep while its GPU reads the block in place: it no
longer counts against the holds its FETCHes may take (ram_holds) but against ram_keeps, and RELEASE
ends a slot's unkept holds before its kept ones. Keys are ExpertKey(layer, expert), the pack's own
key type.
Decoding validates every field (type, range, length) and the message size before anything acts on
it; it never raises anything but ProtocolError. Never pickle.

Versions (HELLO must name this one; the daemon refuses any other with ERROR VERSION):
    1  the messages above.
    2  (2026-11-30) FAIL code CORRUPT: the block was read whole but fails the crc32 its pack recorded;
       its bytes are never served. A v1 client could not decode that FAIL, hence the new version.
    3  (2026-11-30) The RAM tier: READY may name a RAM tier slot outside the client's lease, shared
       with other clients and possibly named by several READYs at once, and a RELEASE lists such a
       slot once per READY; WELCOME adds ram_first_slot and ram_slots (absent: 0) and its shm_bytes
       covers them. A v2 client may take a READY's slot for one of its own (write into it, count it
       against its lease, release it once), hence the new version.
    4  (2026-12-01) Liveness in the protocol: HEARTBEAT (no reply), WELCOME adds heartbeat_interval_ms
       and heartbeat_timeout_ms, and a session silent for heartbeat_timeout_ms ends (ERROR NO_SESSION,
       unasked). Until v3 only the client's ZMTP PINGs with a TTL showed it alive, and libzmq
       disarms that TTL at each message: a client frozen just after a request kept its leases for
       ever. A v3 client sends no HEARTBEAT and would lose its session whenever idle, hence the new
       version.
    5  (2026-12-01) PROMOTE{id} (no reply): a FETCH sent at PREFETCH priority whose keys are needed
       now (the worker's prefetch of a layer that has started and chose them) goes at DEMAND
       priority, in the client's queue and in the readers' queue. Until v4 such keys waited behind
       every other client's demand reads. A v4 daemon would answer PROMOTE with ERROR UNKNOWN_OP,
       which a client reads as the end of its session, hence the new version.
    6  (2026-12-02) A client's RAM hold share apart from its staging: WELCOME adds ram_holds, the RAM
       tier blocks it may hold at once (expertd's client_ram_holds, at most half the tier but never
       fewer than its staging slots; absent or 0: no tier). Until v5 a client held at most as many RAM blocks as it leased staging slots, so
       a worker under expertd's default client_slots (16) could prefetch one layer of a top-8 model
       ahead. expertd also starts a PREFETCH key only while the client uses less than half of its
       holds, its reads into the tier and its staging slots: the rest is its demand's, however many
       prefetches it sends. A v5 client would size its prefetches by its staging alone, hence the
       new version.
    7  (2026-12-03) FAIL code TRUNCATED: the pack file is shorter than its manifest says (it was
       truncated while expertd served it) and the key's block lies past its end; the message names
       both sizes. Until v6 that was an IO_ERROR, which a worker could not tell from a failing read
       worth retrying; no retry helps here (restore the pack, restart expertd). A v6 client could
       not decode that FAIL, hence the new version.
    8  (2026-12-03) KEEP{slots} (no reply) and WELCOME's ram_keeps: a worker whose GPU reads RAM tier
       blocks in place holds them for as long as its device table points at them, which may be for
       the whole run. Until v7 every hold counted against ram_holds, which the client's fetches and
       prefetches need free: such holds would have stalled them. CONDEMNED{slots} (unasked) tells a
       client that a block it keeps failed the scrub's crc32 check. A v7 daemon would answer KEEP
       with ERROR UNKNOWN_OP, which a client reads as the end of its session, hence the new version.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import IntEnum
from typing import Any, Callable, ClassVar

import msgpack

from expertpack.packtools.layout import ExpertKey

PROTOCOL_VERSION = 8
MAX_MESSAGE_BYTES = 1 << 20  # a FETCH of 65,536 keys fits with room to spare
MAX_KEYS = 65536
MAX_TEXT = 1024
MAX_ID = (1 << 63) - 1
MAX_INDEX = (1 << 31) - 1
MAX_CLIENT_NAME = 64  # a client's name goes into the daemon's log: short, one line
MAX_SLOTS = 1 << 20  # as many staging slots as expertd may have
MAX_HEARTBEAT_MS = 6_553_000  # the longest heartbeat_timeout_s expertd accepts


class Op(IntEnum):
    HELLO = 1
    WELCOME = 2
    FETCH = 3
    READY = 4
    FAIL = 5
    RELEASE = 6
    CANCEL = 7
    STATS = 8
    STATS_REPLY = 9
    PING = 10
    PONG = 11
    ERROR = 12
    BYE = 13
    HEARTBEAT = 14  # v4
    PROMOTE = 15  # v5
    KEEP = 16  # v8
    CONDEMNED = 17  # v8


class ErrorCode(IntEnum):
    MALFORMED = 1  # not one msgpack map with an integer op
    UNKNOWN_OP = 2
    BAD_FIELD = 3  # missing, wrongly typed or out of range
    TOO_LARGE = 4
    NO_SESSION = 5  # a request before HELLO
    VERSION = 6  # protocol version not spoken by this daemon
    DUPLICATE_ID = 7  # a FETCH id that is still in flight
    NO_SLOTS = 8  # staging has no slots left to lease to a new client
    SHUTTING_DOWN = 9
    BUSY = 10  # too many keys queued for this client; RELEASE or wait
    FINGERPRINT = 11  # the client's trunk.gguf belongs to another pack than the daemon serves


class FailCode(IntEnum):
    IO_ERROR = 1  # the read failed or came back short; the slot's bytes are not used
    CANCELLED = 2
    SHUTDOWN = 3
    CORRUPT = 4  # v2: the block's bytes fail the pack's crc32 (damaged on disk); the slot's bytes are not used
    TRUNCATED = 5  # v7: the pack is shorter than its manifest (truncated under expertd); no retry helps


class Priority(IntEnum):
    DEMAND = 0  # the worker stalls on it
    PREFETCH = 1  # wanted soon; any demand read overtakes it


def prefetch_budget(share: int) -> int:
    """How much of a client's share (staging slots, RAM tier holds, reads into the tier) its
    PREFETCH keys may take: half, rounded up, and never the last one, which stays for demand. A
    client of one slot prefetches nothing. expertd enforces it (v6) and the worker sizes its
    prefetches by it: one rule for both ends."""
    return share - max(1, share // 2)


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# ---- field validators: raw msgpack value -> typed value, or ValueError with what was expected ----
def _uint(limit: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if type(v) is not int or not 0 <= v <= limit:
            raise ValueError(f"an integer in 0..{limit}")
        return v
    return check


def _text(v: Any) -> str:
    if type(v) is not str or len(v) > MAX_TEXT:
        raise ValueError(f"a string of at most {MAX_TEXT} characters")
    return v


def _enum(enum: type[IntEnum]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is int and v in enum._value2member_map_:
            return enum(v)
        raise ValueError(f"one of {[int(m) for m in enum]}")
    return check


def _key(v: Any) -> ExpertKey:
    if type(v) is not list or len(v) != 2 or any(type(x) is not int or not 0 <= x <= MAX_INDEX for x in v):
        raise ValueError("a [layer, expert] pair of non-negative integers")
    return ExpertKey(v[0], v[1])


def _keys(v: Any) -> tuple[ExpertKey, ...]:
    if type(v) is not list or not 1 <= len(v) <= MAX_KEYS:
        raise ValueError(f"a list of 1..{MAX_KEYS} [layer, expert] pairs")
    return tuple(_key(x) for x in v)


def _slots(v: Any) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_KEYS or any(type(x) is not int or not 0 <= x <= MAX_INDEX for x in v):
        raise ValueError(f"a list of at most {MAX_KEYS} slot numbers")
    return tuple(v)


def _map(v: Any) -> dict[str, Any]:
    if type(v) is not dict or any(type(k) is not str for k in v):
        raise ValueError("a map with string keys")
    return v


def _fingerprint(v: Any) -> str:
    if type(v) is not str or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError("64 lowercase hex digits")
    return v


_ID = _uint(MAX_ID)
_INDEX = _uint(MAX_INDEX)
_BYTES = _uint(1 << 62)

class Message:
    __slots__ = ()
    op: ClassVar[Op]
    checks: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": int(self.op)}
        for f in fields(self):  # type: ignore[arg-type]
            out[f.name] = _wire_value(getattr(self, f.name))
        return out


def _wire_value(v: Any) -> Any:
    if isinstance(v, ExpertKey):
        return [v.layer, v.expert]
    if isinstance(v, IntEnum):
        return int(v)
    if isinstance(v, tuple):
        return [_wire_value(x) for x in v]
    return v


def _fingerprint_or_empty(v: Any) -> str:
    return v if v == "" else _fingerprint(v)


def _client_name(v: Any) -> str:
    if type(v) is not str or not 1 <= len(v) <= MAX_CLIENT_NAME or not v.isprintable():
        raise ValueError(f"1..{MAX_CLIENT_NAME} printable characters (no control or format characters)")
    return v


@dataclass(frozen=True, slots=True)
class Hello(Message):
    op = Op.HELLO
    version: int
    client: str
    fingerprint: str = ""  # the pack the client's trunk.gguf was built with; "" = no check
    slots: int = 0  # staging slots asked for; 0 = the daemon's client_slots
    checks = {"version": _uint(MAX_INDEX), "client": _client_name, "fingerprint": _fingerprint_or_empty,
              "slots": _uint(MAX_SLOTS)}

    def to_wire(self) -> dict[str, Any]:
        out = Message.to_wire(self)
        if not self.slots:  # absent = 0: a HELLO that asks for nothing has protocol 1's bytes
            del out["slots"]
        return out


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    op = Op.WELCOME
    version: int
    fingerprint: str
    model: dict[str, Any]  # arch, n_layer, n_expert, n_expert_used, moe_layers
    shm: str  # name of the staging segment under /dev/shm
    shm_bytes: int
    slot_bytes: int
    slots: tuple[int, ...]  # the slots leased to this client
    # v3: the RAM tier's slots, [ram_first_slot, ram_first_slot + ram_slots) of the same segment;
    # READY may name one of them (a block shared by every client: read it, never write it)
    ram_first_slot: int = 0
    ram_slots: int = 0
    # v4: send something at least this often; silent this long, the session ends (absent: 0, no rule)
    heartbeat_interval_ms: int = 0
    heartbeat_timeout_ms: int = 0
    # v6: the RAM tier blocks this client may hold at once (0: no tier)
    ram_holds: int = 0
    # v8: the RAM tier blocks this client may keep (KEEP) at once, beside ram_holds (0: none)
    ram_keeps: int = 0
    checks = {"version": _uint(MAX_INDEX), "fingerprint": _fingerprint, "model": _map, "shm": _text,
              "shm_bytes": _BYTES, "slot_bytes": _BYTES, "slots": _slots, "ram_first_slot": _INDEX,
              "ram_slots": _INDEX, "ram_holds": _INDEX, "ram_keeps": _INDEX, "heartbeat_interval_ms": _uint(MAX_HEARTBEAT_MS),
              "heartbeat_timeout_ms": _uint(MAX_HEARTBEAT_MS)}


@dataclass(frozen=True, slots=True)
class Fetch(Message):
    op = Op.FETCH
    id: int
    keys: tuple[ExpertKey, ...]
    prio: Priority = Priority.DEMAND
    checks = {"id": _ID, "keys": _keys, "prio": _enum(Priority)}


@dataclass(frozen=True, slots=True)
class Ready(Message):
    op = Op.READY
    id: int
    key: ExpertKey
    slot: int
    nbytes: int
    checks = {"id": _ID, "key": _key, "slot": _INDEX, "nbytes": _BYTES}


@dataclass(frozen=True, slots=True)
class Fail(Message):
    op = Op.FAIL
    id: int
    key: ExpertKey
    code: FailCode
    message: str
    checks = {"id": _ID, "key": _key, "code": _enum(FailCode), "message": _text}


@dataclass(frozen=True, slots=True)
class Release(Message):
    op = Op.RELEASE
    slots: tuple[int, ...]
    checks = {"slots": _slots}


@dataclass(frozen=True, slots=True)
class Keep(Message):
    op = Op.KEEP
    slots: tuple[int, ...]
    checks = {"slots": _slots}


@dataclass(frozen=True, slots=True)
class Condemned(Message):
    op = Op.CONDEMNED
    slots: tuple[int, ...]
    checks = {"slots": _slots}


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    op = Op.CANCEL
    id: int
    checks = {"id": _ID}


@dataclass(frozen=True, slots=True)
class Promote(Message):
    op = Op.PROMOTE
    id: int
    checks = {"id": _ID}


@dataclass(frozen=True, slots=True)
class Stats(Message):
    op = Op.STATS


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    op = Op.STATS_REPLY
    stats: dict[str, Any]
    checks = {"stats": _map}


@dataclass(frozen=True, slots=True)
class Ping(Message):
    op = Op.PING


@dataclass(frozen=True, slots=True)
class Pong(Message):
    op = Op.PONG


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    op = Op.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Error(Message):
    op = Op.ERROR
    code: ErrorCode
    message: str
    checks = {"code": _enum(ErrorCode), "message": _text}


@dataclass(frozen=True, slots=True)
class Bye(Message):
    op = Op.BYE
    reason: str
    checks = {"reason": _text}


# The one dispatch table from op to message class.
MESSAGES: dict[Op, type[Message]] = {cls.op: cls for cls in (
    Hello, Welcome, Fetch, Ready, Fail, Release, Cancel, Stats, StatsReply, Ping, Pong, Error, Bye, Heartbeat,
    Promote, Keep, Condemned)}


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode(raw: bytes) -> Message:
    """One frame -> a validated message; ProtocolError for anything else."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                               max_str_len=MAX_TEXT * 4, max_bin_len=0, max_array_len=MAX_KEYS,
                               max_map_len=4096, max_ext_len=0)
    except Exception as exc:  # msgpack raises a zoo of types for hostile input
        raise ProtocolError(ErrorCode.MALFORMED, f"not one msgpack map ({type(exc).__name__})") from None
    if type(data) is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, "a message must be a msgpack map")
    op = data.get("op")
    if type(op) is not int:
        raise ProtocolError(ErrorCode.MALFORMED, "a message needs an integer `op`")
    try:
        cls = MESSAGES[Op(op)]
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op}") from None
    values = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is not MISSING:
                values[f.name] = f.default
                continue
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.__name__.upper()} needs field `{f.name}`")
        try:
            values[f.name] = cls.checks[f.name](data[f.name])
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.__name__.upper()}.{f.name} must be {exc}") from None
    return cls(**values)
