"""expertd's clients: a session per routing id that said HELLO, what it holds (staging slots, RAM
tier holds) and what it waits for (its keys queued per priority, its requests), and admission.

A session belongs to the connection that said HELLO, and ends with it, when the client says HELLO
again, when it is silent for heartbeat_timeout_s (protocol v4), or when it is cut or unreachable;
its slots and holds then go back at once (a slot being read, when its read completes). A client
is leased the slots its HELLO asks for (client_slots when it asks for none), never more than the
per-client cap (max_client_slots) less what its other sessions lease: a client is its process over
ipc and its CurveZMQ key over tcp (peers.ClientId), so that one client cannot take the staging from
the others by opening more connections. It may hold its RAM hold share of tier blocks
(client_ram_holds, WELCOME's ram_holds; protocol v6), which its client's sessions share alike, and
keep its keep share of them (client_ram_keeps, WELCOME's ram_keeps; v8): a kept hold is one its GPU
reads in place for as long as it likes, counted apart so that its fetches keep their room. When a
HELLO finds too few slots, sessions whose connection has closed (the socket monitor has not said so
yet) end first.
The routing ids of ended sessions are remembered, bounded, for their late messages. Sends nothing:
the server answers."""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey

from .config import DaemonConfig
from .peers import ClientId
from .ram_tier import RamTier
from .staging import SlotState, StagingSegment
from .stats import ClientCounters, Counters

log = logging.getLogger("expertd")

MAX_GONE = 4096  # routing ids of clients whose connection closed, remembered for their late messages
HELLO_AGAIN = "said HELLO again"  # the one end of a session that is not a client lost


@dataclass(eq=False)
class Work:
    """One key of one FETCH, from the client's queue to READY or FAIL."""

    session: "Session"
    request_id: int
    key: ExpertKey
    prio: p.Priority
    submitted_ns: int
    slot: int | None = None
    pieces_left: int = 0
    error: BaseException | None = None
    cancelled: bool = False
    done: bool = False
    ram: bool = False  # `slot` is a RAM tier slot (read into it, or waiting on that read)
    piece_crc32s: list[int | None] = field(default_factory=list)  # per read piece, as the readers found them


@dataclass(eq=False)
class Request:
    works: list[Work]
    open: int  # keys not answered yet


@dataclass(eq=False)
class Session:
    identity: bytes
    fd: int  # the connection that said HELLO; the session is that connection's alone
    name: str
    slots: list[int]
    free: deque[int]
    pending: tuple[deque[Work], deque[Work]] = field(default_factory=lambda: (deque(), deque()))
    requests: dict[int, Request] = field(default_factory=dict)
    queued: int = 0  # keys pending or in flight
    closed: bool = False
    ram_holds: Counter[int] = field(default_factory=Counter)  # RAM slot -> READYs naming it not yet released
    ram_reads: int = 0  # reads into the RAM tier this client started that are in flight
    ram_share: int = 0  # RAM tier blocks it may hold at once (DaemonConfig.ram_hold_share)
    ram_taken: int = 0  # its unkept holds and its keys given a RAM slot, not answered yet
    ram_kept: Counter[int] = field(default_factory=Counter)  # RAM slot -> how many of its holds there are kept (v8)
    ram_keeps: int = 0  # RAM tier blocks it may keep at once (DaemonConfig.ram_keep_share)
    pid: int | None = None  # the peer process (SO_PEERCRED of an ipc connection); None over tcp or when unknown
    owner: ClientId | None = None  # the client its slots count against (max_client_slots); its connection if None
    connected: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)  # its connection's last message (liveness)
    counters: ClientCounters = field(default_factory=ClientCounters)

    def unhold(self, ram: RamTier, index: int, n: int) -> None:
        """Ends `n` of its holds on RAM slot `index` (a RELEASE, or the session's end): its unkept
        ones first, then its kept ones."""
        ram.unhold(ram.slot(index), n)
        unkept = min(n, self.ram_holds[index] - self.ram_kept[index])
        self.ram_holds[index] -= n
        self.ram_taken -= unkept
        self.ram_kept[index] -= n - unkept
        if not self.ram_holds[index]:
            del self.ram_holds[index]
        if self.ram_kept[index] <= 0:
            del self.ram_kept[index]

    def stats(self) -> dict:
        """Its line of STATS: who it is, what it holds and waits for now, and its counters since
        HELLO (README, "Several workers on one expertd")."""
        return {"name": self.name, "pid": self.pid, "connected_s": time.monotonic() - self.connected,
                "slots": len(self.slots), "free": len(self.free), "queued": self.queued,
                "queue_entries": len(self.pending[0]) + len(self.pending[1]),
                "queued_demand": sum(not w.done for w in self.pending[0]),
                "queued_prefetch": sum(not w.done for w in self.pending[1]),
                "requests": len(self.requests), "ram_held": sum(self.ram_holds.values()), "ram_share": self.ram_share,
                "ram_kept": sum(self.ram_kept.values()), "ram_keeps": self.ram_keeps, "ram_reads": self.ram_reads,
                **self.counters.to_dict()}


class NoSlots(Exception):
    """The staging cannot lease what a HELLO asks for; the message says how much is left."""


class Sessions:
    """The live sessions by routing id, and the ended ones' reasons."""

    def __init__(self, config: DaemonConfig, staging: StagingSegment, ram: RamTier, counters: Counters,
                 connection_closed: Callable[[int], bool] = lambda fd: False) -> None:
        self.config = config
        self.staging = staging
        self.ram = ram
        self.counters = counters
        self._connection_closed = connection_closed  # peers.connection_closed: a close not yet reported
        self.live: dict[bytes, Session] = {}
        # Clients whose connection closed: a RELEASE or CANCEL they sent just before closing is read
        # after the disconnect and is the tail of a clean close, not a protocol error. Bounded.
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # routing id -> why its session ended
        self._next_sweep = time.monotonic()  # when silent sessions are next looked for

    def admit(self, identity: bytes, client: str, asked: int, fd: int, pid: int | None,
              owner: ClientId | None = None) -> Session:
        """A HELLO's session (a session already under `identity` ends first): `asked` staging slots,
        client_slots for 0, at most the per-client cap less what `owner`'s other sessions lease.
        NoSlots when that leaves none, or when the staging has not that many unleased."""
        if identity in self.live:
            self.drop(identity, HELLO_AGAIN)
        self._gone.pop(identity, None)
        owner = owner or ClientId("connection", fd)
        asked = asked or self.config.client_slots
        cap = self.config.client_slot_cap
        n_slots = min(asked, cap - self._leased_by(owner))
        if (n_slots <= 0 or self.staging.pool.n_unleased < n_slots) and self._end_closed():
            n_slots = min(asked, cap - self._leased_by(owner))
        if n_slots <= 0:
            mine = [s for s in self.live.values() if s.owner == owner]
            raise NoSlots(f"{asked} slots asked, but {owner} leases {sum(len(s.slots) for s in mine)} slots over "
                          f"{len(mine)} session{'s' if len(mine) != 1 else ''} already, at most {cap} a client "
                          "(max_client_slots): end one of its sessions first, or raise max_client_slots")
        slots = self.staging.pool.lease(identity, n_slots)
        if slots is None:
            raise NoSlots(f"{n_slots} slots asked, {self.staging.pool.n_unleased} of {self.config.stage_slots} "
                          f"staging slots unleased ({len(self.live)} clients hold the rest); ask for fewer, or raise "
                          "stage_slots or lower client_slots")
        others = sum(s.ram_share for s in self.live.values() if s.owner == owner)
        ram_share = self.config.ram_hold_share(len(slots), self.ram.n_slots, others)
        ram_keeps = self.config.ram_keep_share(self.ram.n_slots, ram_share,
                                               sum(s.ram_keeps for s in self.live.values() if s.owner == owner))
        session = self.live[identity] = Session(identity, fd, client, slots, deque(slots), pid=pid, ram_share=ram_share,
                                                ram_keeps=ram_keeps, owner=owner)
        self.counters.clients_total += 1
        others = len(slots) < min(asked, cap)
        log.info("client %r (pid %s) connected: %d slots%s", client, pid if pid is not None else "unknown",
                 len(slots), f" ({asked} asked, at most {cap} a client {owner.kind}"
                             f"{', the rest leased by its other sessions' if others else ''})" if asked > n_slots else "")
        return session

    def _leased_by(self, owner: ClientId) -> int:
        return sum(len(s.slots) for s in self.live.values() if s.owner == owner)

    def _end_closed(self) -> bool:
        """Ends the sessions whose connection has closed though the monitor has not said so yet (a
        client that reconnects at once must not find its old session's slots taken); whether any."""
        closed = [identity for identity, s in self.live.items() if self._connection_closed(s.fd)]
        for identity in closed:
            self.drop(identity, "disconnected")
        return bool(closed)

    def drop(self, identity: bytes, why: str) -> None:
        """Ends a session: queued keys vanish, leased slots return (a slot being read returns when
        its read completes), its RAM tier holds end."""
        session = self.live.pop(identity, None)
        if session is None:
            return
        if why != HELLO_AGAIN:
            self._gone[identity] = why
            if len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)
        session.closed = True
        session.free.clear()
        session.pending = (deque(), deque())
        self.counters.clients_dropped += why != HELLO_AGAIN
        for i in session.slots:
            slot = self.staging.pool.slots[i]
            if slot.state is SlotState.READING:
                continue
            if slot.state is not SlotState.FREE:
                slot.move(SlotState.FREE)
            self.staging.pool.give_back(i)
        held = sum(session.ram_holds.values())
        for i, n in list(session.ram_holds.items()):
            session.unhold(self.ram, i, n)
        log.info("client %r (pid %s) %s: %d slots back, %d RAM tier holds ended", session.name,
                 session.pid if session.pid is not None else "unknown", why, len(session.slots), held)

    def release(self, session: Session, slots: tuple[int, ...]) -> str | None:
        """RELEASE: staging slots go back to the client's free pool; each listing of a RAM slot ends
        one of the client's holds on it (a RAM slot may be listed as often as READY named it). What
        is wrong with `slots` when nothing is released, else None."""
        pool = self.staging.pool.slots
        staged = [i for i in slots if not self.ram.owns(i)]
        ram = Counter(i for i in slots if self.ram.owns(i))
        for i in staged:
            if i >= len(pool) or pool[i].lessee != session.identity or pool[i].state is not SlotState.LEASED:
                return f"slot {i} holds no expert of this client"
        for i, n in ram.items():
            if session.ram_holds[i] < n:
                return f"RAM slot {i} listed {n} times, this client holds it {session.ram_holds[i]} times"
        if len(set(staged)) != len(staged):
            return "a slot is listed twice"
        for i in staged:
            pool[i].move(SlotState.FREE)
            session.free.append(i)
        for i, n in ram.items():
            session.unhold(self.ram, i, n)
        return None

    def keep(self, session: Session, slots: tuple[int, ...]) -> str | None:
        """KEEP (v8): each listing of a RAM slot makes one of the client's unkept holds on it kept,
        within its keep share. What is wrong with `slots` when nothing changes, else None."""
        listed = Counter(slots)
        for i, n in listed.items():
            if not self.ram.owns(i):
                return f"slot {i} is not a RAM tier slot"
            if session.ram_holds[i] - session.ram_kept[i] < n:
                return (f"RAM slot {i} listed {n} times, this client holds it {session.ram_holds[i]} times, "
                        f"{session.ram_kept[i]} of them kept")
        kept = sum(session.ram_kept.values())
        if kept + len(slots) > session.ram_keeps:
            return f"{kept} kept already and {len(slots)} more asked: at most {session.ram_keeps} (WELCOME's ram_keeps)"
        for i, n in listed.items():
            session.ram_kept[i] += n
        session.ram_taken -= len(slots)
        return None

    def drop_on(self, fd: int, why: str) -> None:
        """Ends the sessions of connection `fd`: found by their own fd, not by who sent last on it
        (a closed connection's messages still queued carry its fd, which a new connection may have
        by the time they are read)."""
        for identity in [i for i, s in self.live.items() if s.fd == fd]:
            self.drop(identity, why)

    def silent(self) -> list[tuple[bytes, str]]:
        """Liveness (protocol v4): the sessions whose connection has sent nothing, not even
        HEARTBEAT, for heartbeat_timeout_s, with why, looked for at most every heartbeat
        interval (and second)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return []
        self._next_sweep = now + min(1.0, self.config.heartbeat_interval_s)
        timeout_s = self.config.heartbeat_timeout_s
        return [(identity, f"silent for {now - session.heard:.1f} s, more than heartbeat_timeout_s = {timeout_s:g} s: "
                           "its slots went to other clients")
                for identity, session in self.live.items() if now - session.heard > timeout_s]

    def why_gone(self, identity: bytes) -> str | None:
        """Why the session of `identity` ended, if it ended lately (not by a HELLO again)."""
        return self._gone.get(identity)
