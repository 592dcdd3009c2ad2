"""expertd's main loop: one ZeroMQ ROUTER socket, the reader pool's completions (an eventfd) and the
signal self-pipe, all polled by one thread that owns every piece of state (sessions, requests,
slots), so nothing here takes a lock. A FETCH's keys queue per client (demand before prefetch) and
get one of the client's leased slots each; reads land in the slot; each reader thread checksums
the piece it read, and once every piece is in, their crc32s joined (block_crc.py) are the block's,
checked against the manifest's (packs of format 1.1); only then does READY name the slot: a block
that fails the check is FAILed CORRUPT, counted and logged by (layer, expert), and the daemon
serves every other key on.
A client that disconnects loses its leases: a session keeps the fd (ZMQ_SRCFD) of the connection
that said HELLO, the socket monitor reports a closed connection's fd, and that ends the sessions on
it. A client that stays connected but sends nothing (frozen: SIGSTOP, a hung host) loses them once
heartbeat_timeout_s passes since its last message (protocol v4: clients send HEARTBEAT at least
every heartbeat_interval_s, which WELCOME names); it is told so by an unasked ERROR NO_SESSION,
read when it runs again. The daemon sends no ZMTP heartbeats and never stops
reading a connection (RCVHWM 0): libzmq 4.3.5 aborts (issue 4841, `!_io_error` in
stream_engine_base.cpp) when it writes, on a heartbeat timer or answering a peer's PING, to a
connection whose peer closed while its receive pipe was stopped. The cost: messages a peer sends
faster than the main loop reads them queue inside libzmq, about 80 MB per million small ones; so a
peer that keeps the loop saturated while the heap grows is cut (flood.py: shutdown() of its connections, its leftovers
dropped unread, its process's new connections cut on accept for FLOOD_BAN_S), and STATS, the one
large answer, is answered MAX_STATS_PER_S times a second per connection. The monitor is drained before each message is handled, so a
disconnect that came first is seen first. A message that fails validation gets ERROR and changes nothing.
A session belongs to the connection that said HELLO. A peer that connects with a routing id
already in use takes it over (ROUTER_HANDOVER: libzmq otherwise keeps every such ignored
connection's pipes, ~20 kB each, for the life of the socket); the session of the connection it
took over ends then, so it never inherits that session's slots, and must say HELLO itself; a
connection that takes a routing id over and stays silent leaves the old session nothing to say
either, and it ends heartbeat_timeout_s later. The connection taken over has no pipe left: if it
sent more and then closed, libzmq would keep it, an fd and some kB, until the daemon exits, so the
daemon shuts it down (shutdown() of a duplicate of its fd) at the first message that shows the
takeover. Only peers that choose their routing id do this; ExpertClient does not.
A client is leased the slots its HELLO asks for (client_slots when it asks for none), never more
than the per-client cap (max_client_slots), so that one client cannot take the staging from the
others.
The RAM tier (ram_tier.py, protocol v3) sits in front of the reads: a key resident there is
answered at once with READY naming its RAM slot (a hold, ended by RELEASE like a lease); a key
being read into it waits for that read; a miss the policy admits is read into a RAM slot instead of
the client's staging slot, and is resident for everyone once its crc32 check passed. A client
holds at most its RAM hold share of blocks (client_ram_holds, at most half the tier but never
fewer than its staging slots, WELCOME's ram_holds; protocol v6) and has at most as many reads into the tier in flight as it leases staging
slots, so one client cannot pin the tier nor take every reader. Its PREFETCH keys take at most half
of each (holds, reads, staging slots), whatever the client sends: the rest stays for its demand,
which its prefetches therefore never hold up, however far ahead the client sends them (its own
demand's holds are its to give back: the worker does so before a fetch runs out of them).
Several workers (one per GPU) share one daemon as so many clients: STATS reports each one's pid
(SO_PEERCRED of its ipc connection), what it holds and waits for, and its counters since HELLO."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import signal
import socket
import stat
import struct
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey

from .block_crc import CrcJoiner
from .config import DaemonConfig
from .flood import FLOOD_BAN_S, Flooder, FloodGuard, StatsBudget, anon_bytes
from .notify import notify, watchdog_interval_s
from .reader import CorruptBlock, OpenPack, ReaderPool, ReadJob, open_pack
from .ram_tier import RamSlot, RamState, RamTier, ram_slot_count
from .staging import SlotState, StagingSegment, lockable_bytes, remove_orphans
from .stats import ClientCounters, Counters, Histogram

log = logging.getLogger("expertd")

MAX_QUEUED_KEYS = 4 * p.MAX_KEYS  # per client: pending + in flight
SEND_HWM = MAX_QUEUED_KEYS + 1024  # every queued key may end in one message
RECV_HWM = 0  # unlimited: see _bind and the module docstring
DRAIN_TIMEOUT_S = 10.0  # at shutdown, how long in-flight reads may take to finish
MAX_GONE = 4096  # routing ids of clients whose connection closed, remembered for their late messages


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
    ram_taken: int = 0  # its holds (ram_holds summed) and its keys given a RAM slot, not answered yet
    pid: int | None = None  # the peer process (SO_PEERCRED of an ipc connection); None over tcp or when unknown
    connected: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)  # its connection's last message (liveness)
    counters: ClientCounters = field(default_factory=ClientCounters)


def _room(share: int, prefetch: bool) -> int:
    """How much of a client's share (RAM holds, reads into the tier, staging slots) a key may find in
    use and still start: all of it for demand, the protocol's prefetch budget for a prefetch (a
    client of one slot's prefetches wait until promoted or cancelled)."""
    return p.prefetch_budget(share) if prefetch else share


class ExpertDaemon:
    def __init__(self, config: DaemonConfig) -> None:
        assert config.pack is not None
        self.config = config
        self._closed = False
        self._socket_inode: tuple[int, int] | None = None  # the socket file this daemon bound, once bound
        self._lock_fd: int | None = None  # flock on <socket>.lock: one expertd per ipc endpoint, start to exit
        self.pack: OpenPack = open_pack(config.pack, config.direct_io, config.read_splits)
        self.manifest = self.pack.manifest
        self.layers = {l.layer: l for l in self.manifest.layers}
        self.check_crc32 = self.manifest.has_crc32
        if not self.check_crc32:
            log.warning("%s was built before pack format 1.1 and has no block crc32s: blocks are served without "
                        "a check as they are read (`expertpack verify` checks their sha256; a rebuild adds the "
                        "crc32s)", config.pack)
        # Per layer, how many payload bytes of each read piece are checksummed (0: a piece of padding)
        self._crc_bytes = {l.layer: tuple(max(0, min(length, l.payload_bytes - start))
                                          for start, length in self.pack.splits[l.layer])
                           for l in self.manifest.layers} if self.check_crc32 else {}
        self._crc_joiner = CrcJoiner(n for lengths in self._crc_bytes.values() for n in lengths if n)
        self.started = time.monotonic()
        self.counters = Counters()
        self.read_latency = Histogram()
        self.fetch_latency = Histogram()
        self.sessions: dict[bytes, Session] = {}
        self._waiting: dict[int, list[Work]] = {}  # RAM slot being read -> the keys answered when it is in
        # Clients whose connection closed: a RELEASE or CANCEL they sent just before closing is read
        # after the disconnect and is the tail of a clean close, not a protocol error. Bounded.
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # routing id -> why its session ended
        self._next_sweep = time.monotonic()  # when silent sessions are next looked for
        self.flood = FloodGuard()
        self.stats_budget = StatsBudget()
        self._open_fds: dict[int, int | None] = {}  # connections open now (monitor) -> the peer pid at accept
        # Connections cut for flooding, by fd, until the fd is another connection's: what they left
        # queued is read and dropped unread.
        self._cut: set[int] = set()
        self._banned: dict[int, float] = {}  # pid cut for flooding -> until when its new connections are cut
        # Which connection each routing id last came from, and back: a message under an id from
        # another fd is a takeover (ROUTER_HANDOVER), and the connection it took the id from is closed.
        self._fd_of: dict[bytes, int] = {}
        self._id_on: dict[int, bytes] = {}
        self.stopping = False
        self._completions: queue.SimpleQueue[tuple[ReadJob, BaseException | None, int]] = queue.SimpleQueue()
        try:
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            for orphan in remove_orphans():
                log.warning("removed %s, the staging of an expertd that is gone", orphan)
            slot_bytes = self.manifest.max_stride
            n_blocks = len(self.manifest.layers) * self.manifest.model.n_expert
            ram_slots, self.ram_why = ram_slot_count(config.ram_cache_gib, slot_bytes, config.stage_slots * slot_bytes,
                                                     lockable_bytes()[0], n_blocks)
            self.staging = StagingSegment(config.stage_slots, slot_bytes, ram_slots=ram_slots)
            self.ram = RamTier(config.stage_slots, ram_slots)
            if ram_slots and not self.staging.ram_locked:
                log.warning("the RAM tier (%s bytes) is not locked in memory: mlock failed (%s); it is served "
                            "unlocked and may be swapped out. Raise the memlock limit (systemd: "
                            "LimitMEMLOCK=infinity; shell: ulimit -l unlimited) to lock it",
                            f"{ram_slots * slot_bytes:,}", self.staging.ram_lock_error)
            self.ctx = zmq.Context()
            self.router = self._bind()
            self.monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self.readers = ReaderPool(self.pack.fd, config.read_threads, self._on_read_done)
        except BaseException:
            self.close()  # whatever was created so far: no shm or socket outlives a failed start
            raise

    # ---- set-up ------------------------------------------------------------------------------
    def _bind(self) -> zmq.Socket:
        cfg = self.config
        sock = self.ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # see the module docstring
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            # libzmq 4.3.5 aborts (issue 4841) when it writes to a connection whose peer closed while
            # its receive pipe was stopped. An unlimited receive pipe never stops a live connection,
            # and with no ZMTP heartbeats of its own the daemon never writes to one on a timer.
            sock.setsockopt(zmq.RCVHWM, RECV_HWM)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
            # Up to 4x the protocol's limit arrives and gets ERROR TOO_LARGE; beyond, zmq drops the peer.
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * p.MAX_MESSAGE_BYTES)
            if cfg.endpoint.startswith("tcp://"):
                assert cfg.curve_secret_key_file is not None
                public, secret = zmq.auth.load_certificate(str(cfg.curve_secret_key_file))
                if secret is None:
                    raise ValueError(f"{cfg.curve_secret_key_file} holds no secret key (make one with zmq.auth.create_certificates)")
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            else:
                path = Path(cfg.endpoint.removeprefix("ipc://"))
                if not path.parent.is_dir():
                    raise ValueError(f"{cfg.endpoint}: directory {path.parent} does not exist "
                                     "(systemd creates it with RuntimeDirectory=expertpack)")
                self._lock_fd = _lock_endpoint(path)
                _remove_stale_socket(path)
            sock.bind(cfg.endpoint)
            if cfg.endpoint.startswith("ipc://"):
                path = Path(cfg.endpoint.removeprefix("ipc://"))
                os.chmod(path, 0o660)  # group shared with workers
                self._socket_inode = _inode(path)
            return sock
        except BaseException:
            sock.close(0)  # an open socket would hang the context's term() in close()
            raise

    # ---- main loop ---------------------------------------------------------------------------
    def serve(self) -> int:
        sig_r, sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous_fd = signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        caught: list[int] = []
        handlers = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(sig_r, zmq.POLLIN)
        watchdog = watchdog_interval_s()
        next_ping = time.monotonic()
        log.info("serving %s on %s: %s, %d MoE layers x %d experts, %d staging slots of %d bytes (%s), "
                 "RAM tier %d slots (%s bytes, %s; %s), %d reader threads, %s reads", self.config.pack,
                 self.config.endpoint, self.manifest.model.arch, len(self.layers), self.manifest.model.n_expert,
                 self.config.stage_slots, self.staging.slot_bytes, self.staging.path, self.ram.n_slots,
                 f"{self.ram.n_slots * self.staging.slot_bytes:,}", self.ram_why,
                 "locked" if self.staging.ram_locked or not self.ram.n_slots else "NOT locked",
                 self.config.read_threads, "O_DIRECT" if self.pack.direct else "buffered")
        notify("READY=1", f"STATUS=serving {self.config.pack} on {self.config.endpoint}")
        try:
            while not caught:
                wait_s = min(1.0, self.config.heartbeat_interval_s, watchdog or 1.0)
                events = dict(poller.poll(max(1, int(wait_s * 1000))))
                if self._wake in events:
                    self._drain_completions()
                if self.monitor in events:
                    self._drain_monitor()
                if self.router in events:
                    self._drain_router()
                self._end_silent_sessions()
                if sig_r in events:
                    while True:
                        try:
                            os.read(sig_r, 64)
                        except BlockingIOError:
                            break
                if watchdog is not None and time.monotonic() >= next_ping:
                    notify("WATCHDOG=1")
                    next_ping = time.monotonic() + watchdog
            log.info("%s received: shutting down", signal.Signals(caught[0]).name)
            self._shutdown()
        except BaseException:
            self.close()  # a bug must not leave the shared memory and the socket behind
            raise
        finally:
            signal.set_wakeup_fd(previous_fd)
            for s, h in handlers.items():
                signal.signal(s, h)
            os.close(sig_r)
            os.close(sig_w)
        return 0

    def _drain_router(self) -> None:
        for _ in range(1000):  # then let completions in
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._after_batch(False)
                return
            self._drain_monitor()  # disconnects that happened before this message come first
            identity = frames[0].bytes
            fd = frames[-1].get(zmq.SRCFD)
            # The sender's pid as its own connection recorded it: a closed connection's messages
            # still queued carry its fd, which another process's connection may have by now.
            sender = _sender_pid(frames[-1])
            if fd in self._cut or (sender is not None and self._banned.get(sender, 0.0) > time.monotonic()):
                continue  # left queued by a connection cut for flooding (on an fd reused since, too): dropped unread
            holder = self._open_fds.get(fd)
            late = sender is not None and holder is not None and sender != holder
            pid = sender if sender is not None else holder
            self.flood.seen(pid if pid is not None else ("connection", fd))
            session = self.sessions.get(identity)
            if not late:  # a late message says nothing of who holds its fd or its routing id now
                self._note_connection(identity, fd)
                if session is not None and session.fd != fd:
                    self._drop(identity, "lost its routing id to another connection")
                elif session is not None:
                    session.heard = time.monotonic()
            if len(frames) != 2:
                self._error(identity, p.ErrorCode.MALFORMED, f"expected one frame per message, got {len(frames) - 1}")
                continue
            try:
                msg = p.decode(frames[1].bytes)
            except p.ProtocolError as exc:
                self._error(identity, exc.code, exc.message)
                continue
            if late and isinstance(msg, p.Hello):  # its client is gone: a session would hold slots for nobody
                log.debug("HELLO of pid %d read after its connection closed: no session", sender)
                continue
            self._handle(identity, msg, fd, pid)
        self._after_batch(bool(self.router.get(zmq.EVENTS) & zmq.POLLIN))

    def _note_connection(self, identity: bytes, fd: int) -> None:
        """Remembers which connection `identity` speaks on. One that took the id over from another
        open connection (ROUTER_HANDOVER) gets the old one closed: libzmq leaves it without a pipe,
        open until the daemon exits if it sends on, so the daemon shuts it down itself."""
        if fd < 0 or fd not in self._open_fds:
            return  # a closed connection's late message: it says nothing about who holds the id now
        previous = self._fd_of.get(identity)
        if previous == fd:
            return
        if previous is not None and self._id_on.get(previous) == identity:
            log.debug("routing id %r taken over by another connection: closing the old one (fd %d)", identity, previous)
            self._shutdown_fd(previous)
            del self._id_on[previous]
        old_id = self._id_on.get(fd)
        if old_id is not None and self._fd_of.get(old_id) == fd:
            del self._fd_of[old_id]
        self._fd_of[identity] = fd
        self._id_on[fd] = identity

    def _forget_fd(self, fd: int) -> None:
        """A connection accepted or closed on `fd`: what was noted of the fd's previous connection goes."""
        identity = self._id_on.pop(fd, None)
        if identity is not None and self._fd_of.get(identity) == fd:
            del self._fd_of[identity]

    def _after_batch(self, backlogged: bool) -> None:
        flooder = self.flood.after_batch(anon_bytes() if backlogged else None)
        if flooder is not None:
            self._cut_peer(flooder)

    def _cut_peer(self, flooder: Flooder) -> None:
        """Closes the connections of a peer that outruns the main loop (flood.py), so that what it
        sends stops queueing in memory: shutdown() on a duplicate of each fd, which libzmq sees as
        the peer closing (a disconnect, ending any session on it). Only connections the monitor
        says are open now, and over ipc only those whose peer is still the process that opened
        them (an fd may be another connection's by now)."""
        peer = flooder.peer
        if isinstance(peer, int):
            fds = [fd for fd, pid in self._open_fds.items() if pid == peer and _peer_pid(fd) == peer]
        else:
            fds = [peer[1]] if peer[1] in self._open_fds else []
        if not fds:
            return  # closed already: what it left drains
        log.warning("cutting %d connection(s) of %s: it sent %d messages, faster than expertd reads them, while "
                    "expertd's memory grew %d MiB with what waits to be read; what it left queued is dropped",
                    len(fds), f"pid {peer}" if isinstance(peer, int) else "a tcp peer", flooder.messages,
                    self.flood.growth_bytes >> 20)
        self.counters.floods_cut += 1
        if isinstance(peer, int):
            self._banned[peer] = time.monotonic() + FLOOD_BAN_S
        for fd in fds:
            self._cut_fd(fd)

    def _cut_fd(self, fd: int) -> None:
        self._cut.add(fd)
        for identity in [i for i, s in self.sessions.items() if s.fd == fd]:
            self._drop(identity, "cut for flooding")
        self._shutdown_fd(fd)

    @staticmethod
    def _shutdown_fd(fd: int) -> None:
        """Closes a connection under libzmq: shutdown() of a duplicate of its fd (libzmq's I/O thread
        owns the fd and closes it), seen by libzmq as the peer closing."""
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            log.debug("shutdown of fd %d: %s", fd, exc)

    def _accepted(self, fd: int) -> None:
        """A new connection: its peer's pid noted; one of a process cut for flooding is cut at once."""
        pid = _peer_pid(fd)
        self._open_fds[fd] = pid
        now = time.monotonic()
        for banned in [b for b, until in self._banned.items() if until <= now]:
            del self._banned[banned]
        if pid is not None and pid in self._banned:
            self.counters.floods_cut += 1
            log.debug("cutting a new connection of pid %d, cut for flooding %.0f s ago", pid,
                      FLOOD_BAN_S - (self._banned[pid] - now))
            self._cut_fd(fd)
        else:
            self._cut.discard(fd)  # another connection's now; a cut one's leftovers are served as usual

    def _handle(self, identity: bytes, msg: p.Message, fd: int = -1, pid: int | None = None) -> None:
        if isinstance(msg, p.Ping):
            self._send(identity, p.Pong())
        elif isinstance(msg, p.Stats):
            if self.stats_budget.take(identity, time.monotonic()):
                self._send(identity, p.StatsReply(self.stats()))
            else:
                self._error(identity, p.ErrorCode.BUSY, f"at most {self.stats_budget.per_s} STATS a second per "
                            "connection: ask less often")
        elif isinstance(msg, p.Hello):
            self._hello(identity, msg, fd, pid)
        elif isinstance(msg, p.Heartbeat):
            return  # its arrival was the point (_drain_router); a late one of an ended session says nothing
        elif identity not in self.sessions:
            if identity in self._gone and isinstance(msg, (p.Release, p.Cancel)):
                log.debug("%s from %r after its session ended: nothing to do", msg.op.name, identity)
                return
            why = self._gone.get(identity)
            self._error(identity, p.ErrorCode.NO_SESSION, f"{msg.op.name} before HELLO" if why is None else
                        f"{msg.op.name} from a client whose session ended ({why}); say HELLO again")
        elif isinstance(msg, p.Fetch):
            self._fetch(self.sessions[identity], msg)
        elif isinstance(msg, p.Release):
            self._release(self.sessions[identity], msg)
        elif isinstance(msg, p.Cancel):
            self._cancel(self.sessions[identity], msg)
        elif isinstance(msg, p.Promote):
            self._promote(self.sessions[identity], msg)
        else:
            self._error(identity, p.ErrorCode.UNKNOWN_OP, f"{msg.op.name} is sent by the daemon, not to it")

    # ---- requests ----------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: p.Hello, fd: int, pid: int | None) -> None:
        if msg.version != p.PROTOCOL_VERSION:
            self._error(identity, p.ErrorCode.VERSION,
                        f"client speaks protocol {msg.version}, this expertd speaks {p.PROTOCOL_VERSION}")
            return
        if self.stopping:
            self._error(identity, p.ErrorCode.SHUTTING_DOWN, "expertd is shutting down")
            return
        if msg.fingerprint and msg.fingerprint != self.manifest.fingerprint:
            self._error(identity, p.ErrorCode.FINGERPRINT,
                        f"this expertd serves pack {self.manifest.fingerprint} ({self.config.pack}), but the client's "
                        f"trunk.gguf was built with pack {msg.fingerprint}; point one of them at the other's pack")
            return
        if identity in self.sessions:
            self._drop(identity, "said HELLO again")
        self._gone.pop(identity, None)
        asked = msg.slots or self.config.client_slots
        n_slots = min(asked, self.config.client_slot_cap)
        slots = self.staging.pool.lease(identity, n_slots)
        if slots is None:
            self._error(identity, p.ErrorCode.NO_SLOTS,
                        f"{n_slots} slots asked, {self.staging.pool.n_unleased} of {self.config.stage_slots} staging "
                        f"slots unleased ({len(self.sessions)} clients hold the rest); ask for fewer, or raise "
                        "stage_slots or lower client_slots")
            return
        ram_share = self.config.ram_hold_share(len(slots), self.ram.n_slots)
        self.sessions[identity] = Session(identity, fd, msg.client, slots, deque(slots), pid=pid, ram_share=ram_share)
        self.counters.clients_total += 1
        log.info("client %r (pid %s) connected: %d slots%s", msg.client, pid if pid is not None else "unknown",
                 len(slots),
                 f" ({asked} asked, at most {self.config.client_slot_cap} a client)" if asked > n_slots else "")
        m = self.manifest
        self._send(identity, p.Welcome(
            version=p.PROTOCOL_VERSION, fingerprint=m.fingerprint,
            model={"arch": m.model.arch, "n_layer": m.model.n_layer, "n_expert": m.model.n_expert,
                   "n_expert_used": m.model.n_expert_used, "moe_layers": list(m.model.moe_layers)},
            shm=self.staging.name, shm_bytes=self.staging.size_bytes, slot_bytes=self.staging.slot_bytes,
            slots=tuple(slots), ram_first_slot=self.ram.first_slot, ram_slots=self.ram.n_slots, ram_holds=ram_share,
            heartbeat_interval_ms=round(self.config.heartbeat_interval_s * 1000),
            heartbeat_timeout_ms=round(self.config.heartbeat_timeout_s * 1000)))

    def _fetch(self, session: Session, msg: p.Fetch) -> None:
        if self.stopping:
            self._error(session.identity, p.ErrorCode.SHUTTING_DOWN, "expertd is shutting down")
            return
        if msg.id in session.requests:
            self._error(session.identity, p.ErrorCode.DUPLICATE_ID, f"FETCH id {msg.id} is still in flight")
            return
        n_expert = self.manifest.model.n_expert
        for key in msg.keys:
            if key.layer not in self.layers or key.expert >= n_expert:
                self._error(session.identity, p.ErrorCode.BAD_FIELD,
                            f"FETCH.keys: {list(key)} is not an expert of this pack (MoE layers "
                            f"{list(self.manifest.model.moe_layers)}, experts 0..{n_expert - 1})")
                return
        if session.queued + len(msg.keys) > MAX_QUEUED_KEYS:
            self._error(session.identity, p.ErrorCode.BUSY,
                        f"{session.queued} keys already queued; at most {MAX_QUEUED_KEYS} per client")
            return
        now = time.monotonic_ns()
        works = [Work(session, msg.id, key, msg.prio, now) for key in msg.keys]
        session.requests[msg.id] = Request(works, len(works))
        session.pending[msg.prio].extend(works)
        session.queued += len(works)
        self.counters.fetches += 1
        self.counters.keys += len(works)
        session.counters.fetches += 1
        session.counters.keys += len(works)
        self.ram.touch(msg.keys)
        self._dispatch(session)

    def _release(self, session: Session, msg: p.Release) -> None:
        """Staging slots go back to the client's free pool; each listing of a RAM slot ends one of
        the client's holds on it (a RAM slot may be listed as often as READY named it)."""
        slots = self.staging.pool.slots
        staged = [i for i in msg.slots if not self.ram.owns(i)]
        ram = Counter(i for i in msg.slots if self.ram.owns(i))
        for i in staged:
            if i >= len(slots) or slots[i].lessee != session.identity or slots[i].state is not SlotState.LEASED:
                self._error(session.identity, p.ErrorCode.BAD_FIELD,
                            f"RELEASE.slots: slot {i} holds no expert of this client")
                return
        for i, n in ram.items():
            if session.ram_holds[i] < n:
                self._error(session.identity, p.ErrorCode.BAD_FIELD,
                            f"RELEASE.slots: RAM slot {i} listed {n} times, this client holds it {session.ram_holds[i]} "
                            "times")
                return
        if len(set(staged)) != len(staged):
            self._error(session.identity, p.ErrorCode.BAD_FIELD, "RELEASE.slots: a slot is listed twice")
            return
        for i in staged:
            slots[i].move(SlotState.FREE)
            session.free.append(i)
        for i, n in ram.items():
            self._unhold(session, i, n)
        self._dispatch(session)

    def _unhold(self, session: Session, index: int, n: int) -> None:
        self.ram.unhold(self.ram.slot(index), n)
        session.ram_holds[index] -= n
        session.ram_taken -= n
        if not session.ram_holds[index]:
            del session.ram_holds[index]

    def _cancel(self, session: Session, msg: p.Cancel) -> None:
        request = session.requests.get(msg.id)
        if request is None:
            return  # already answered in full: a cancel racing the last READY is not an error
        for work in request.works:
            if work.done or work.cancelled:
                continue
            work.cancelled = True
            if work.slot is None:  # still queued: answer now
                self._finish(work, p.FailCode.CANCELLED, "cancelled")
        # Answered keys leave the queues now, so repeated FETCH + CANCEL cannot grow them.
        session.pending = tuple(deque(w for w in q if not w.done) for q in session.pending)

    def _promote(self, session: Session, msg: p.Promote) -> None:
        """PROMOTE (v5): the FETCH's keys not answered yet go at DEMAND priority: those still in the
        client's queue move to its demand queue (behind the demand already there), those being read
        move up the readers' queue, and so does the read a key waits on in the RAM tier."""
        request = session.requests.get(msg.id)
        if request is None:
            return  # answered in full already: a promote racing the last READY is not an error
        promoted = [w for w in request.works if not w.done and not w.cancelled and w.prio is not p.Priority.DEMAND]
        for work in promoted:
            work.prio = p.Priority.DEMAND
            if work.slot is None:
                continue  # still queued: moved below
            reader = self._waiting.get(work.slot, [work])[0] if work.ram else work  # whose read fills the slot
            reader.prio = p.Priority.DEMAND
            self.readers.promote(reader, int(p.Priority.DEMAND))
        queued = {id(w) for w in promoted if w.slot is None}
        if queued:
            demand, prefetch = session.pending
            session.pending = (deque([*demand, *(w for w in prefetch if id(w) in queued)]),
                               deque(w for w in prefetch if id(w) not in queued))
            self._dispatch(session)

    # ---- reads -------------------------------------------------------------------------------
    def _dispatch(self, session: Session) -> None:
        """Answers or starts the session's queued keys in order, demand first, until one needs a
        staging slot (or a RAM hold) the client does not have free."""
        if session.closed:
            return
        demand, prefetch = session.pending
        while demand or prefetch:
            queue_ = demand if demand else prefetch
            if not queue_[0].done and not self._start(session, queue_[0]):
                return
            queue_.popleft()

    def _start(self, session: Session, work: Work) -> bool:
        """A RAM hit is answered now; a key being read into the RAM tier waits for that read; a
        miss is read into a RAM slot if the policy admits it, else into a free staging slot of the
        client. False when none of these can happen yet: the client holds its share of the tier
        (it must RELEASE), has its share of reads into it in flight, or has no staging slot free; a
        prefetch, when it would take more than half of any of them (the rest is its demand's)."""
        prefetch = work.prio is not p.Priority.DEMAND
        n_slots = len(session.slots)
        hold_room = _room(session.ram_share, prefetch)
        read_room = _room(n_slots, prefetch)
        resident = self.ram.lookup(work.key)
        if resident is not None:
            if session.ram_taken >= hold_room:
                return False
            self.counters.ram_hits += 1
            session.counters.ram_hits += 1
            work.slot, work.ram = resident.index, True
            session.ram_taken += 1
            if resident.state is RamState.RESIDENT:
                self._ready_ram(work, resident)
                return True
            waiting = self._waiting[resident.index]
            reader = waiting[0]  # the key whose read fills the slot
            if work.prio < reader.prio:  # demand joins a prefetch's read: it goes at demand priority now
                reader.prio = work.prio
                self.readers.promote(reader, int(work.prio))
            waiting.append(work)
            return True
        if self.ram.n_slots:
            if session.ram_taken >= hold_room or session.ram_reads >= read_room:
                return False  # a read or a RELEASE of its own lets it on; the key may still be admitted then
            claim = self.ram.claim(work.key, self.layers[work.key.layer].payload_bytes)
            if claim is not None:
                self.counters.ram_misses += 1
                session.counters.ram_misses += 1
                self.counters.ram_evictions += claim.evicted is not None
                session.ram_reads += 1
                work.slot, work.ram = claim.slot.index, True
                session.ram_taken += 1
                self._waiting[claim.slot.index] = [work]
                self._read(work)
                return True
        if n_slots - len(session.free) >= read_room:  # the staging slots in use: none free, or half for a prefetch
            return False
        self.counters.ram_misses += 1
        session.counters.ram_misses += 1
        slot = session.free.popleft()
        self.staging.pool.slots[slot].move(SlotState.READING)
        work.slot = slot
        self._read(work)
        return True

    def _read(self, work: Work) -> None:
        """Queues the reads of the work's block into its slot (staging or RAM: one segment)."""
        assert work.slot is not None
        layer = self.layers[work.key.layer]
        block = layer.block_offset(work.key.expert)
        pieces = self.pack.splits[layer.layer]
        work.pieces_left = len(pieces)
        work.piece_crc32s = [None] * len(pieces)
        crc_bytes = self._crc_bytes.get(layer.layer) or (0,) * len(pieces)
        for i, (start, length) in enumerate(pieces):
            self.readers.submit(int(work.prio), block + start, self.staging.view(work.slot, start, start + length), work,
                                piece=i, crc_bytes=crc_bytes[i])

    def _check(self, work: Work) -> None:
        """Compares the crc32 of the block just read (joined from its pieces') with the manifest's;
        a mismatch becomes the work's error (CorruptBlock), so no byte of the block is served."""
        if work.error is not None or not self.check_crc32:
            return
        layer = self.layers[work.key.layer]
        found = self._crc_joiner.join((crc, n) for crc, n in zip(work.piece_crc32s, self._crc_bytes[layer.layer]) if n)
        self.counters.checked_blocks += 1
        self.counters.checked_bytes += layer.payload_bytes
        expected = layer.crc32[work.key.expert]
        if found != expected:
            work.error = CorruptBlock(layer.block_offset(work.key.expert), layer.payload_bytes, expected, found)

    def _ready_ram(self, work: Work, slot: RamSlot) -> None:
        """READY naming a resident RAM block: the client holds it until it releases it."""
        self.ram.hold(slot)
        work.session.ram_holds[slot.index] += 1
        self.fetch_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
        self._finish(work, None, "", p.Ready(work.request_id, work.key, slot.index, slot.nbytes))

    def _on_read_done(self, job: ReadJob, error: BaseException | None, elapsed_ns: int) -> None:
        """Reader thread: hand over to the main loop."""
        self._completions.put((job, error, elapsed_ns))
        os.eventfd_write(self._wake, 1)

    def _drain_completions(self) -> None:
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        while True:
            try:
                job, error, elapsed_ns = self._completions.get_nowait()
            except queue.Empty:
                return
            nbytes = job.dest.nbytes
            job.dest.release()
            work: Work = job.token
            work.piece_crc32s[job.piece] = job.crc32
            self.read_latency.add_ns(elapsed_ns)
            self.counters.read_ops += 1
            if not self.pack.direct:
                self.counters.fallback_count += 1
            if error is None:
                self.counters.pack_read_bytes += nbytes
                work.session.counters.read_bytes += nbytes
            else:
                work.error = error
                self.counters.io_errors += 1
            work.pieces_left -= 1
            if work.pieces_left == 0:
                self._read_complete(work)

    def _read_complete(self, work: Work) -> None:
        if work.ram:
            self._ram_read_complete(work)
            return
        slot = self.staging.pool.slots[work.slot]
        session = work.session
        if not work.cancelled and not session.closed:
            self._check(work)
        if session.closed:  # the client is gone: its slot leaves with it
            slot.move(SlotState.FREE)
            self.staging.pool.give_back(slot.index)
            return
        if work.error is not None or work.cancelled:
            slot.move(SlotState.FREE)
            session.free.append(slot.index)
            if work.cancelled:
                self._finish(work, p.FailCode.CANCELLED, "cancelled")
            elif isinstance(work.error, CorruptBlock):
                self.counters.corrupt_blocks += 1
                layer, expert = work.key
                log.error("corrupt block: layer %d expert %d of %s fails its crc32 check (%s); FAILed CORRUPT, "
                          "never served (run expertpack verify %s; rebuild or restore the pack)",
                          layer, expert, self.pack.path, work.error, self.config.pack)
                self._finish(work, p.FailCode.CORRUPT,
                             f"layer {layer} expert {expert} of {self.pack.path} is corrupt: {work.error}; "
                             f"run expertpack verify {self.config.pack}")
            else:
                log.warning("read of %s failed: %s", list(work.key), work.error)
                self._finish(work, p.FailCode.IO_ERROR, f"read failed: {work.error}")
        else:
            slot.move(SlotState.READY)
            slot.move(SlotState.LEASED)
            layer = self.layers[work.key.layer]
            self.fetch_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
            self._finish(work, None, "", p.Ready(work.request_id, work.key, slot.index, layer.payload_bytes))
        self._dispatch(session)

    def _ram_read_complete(self, work: Work) -> None:
        """A read into the RAM tier is in: checked (even if its own client left or cancelled: the
        block is for everyone), then resident and answered to every key waiting on it, or, failed
        or corrupt, dropped and FAILed to them all."""
        slot = self.ram.slot(work.slot)
        self._check(work)  # even if its own client left or cancelled: the block is for everyone
        work.session.ram_reads -= 1
        waiting = self._waiting.pop(slot.index)
        self.ram.filled(slot, work.error is None)
        if isinstance(work.error, CorruptBlock):
            self.counters.corrupt_blocks += 1
            layer, expert = work.key
            log.error("corrupt block: layer %d expert %d of %s fails its crc32 check (%s); FAILed CORRUPT, "
                      "never served (run expertpack verify %s; rebuild or restore the pack)",
                      layer, expert, self.pack.path, work.error, self.config.pack)
        elif work.error is not None:
            log.warning("read of %s failed: %s", list(work.key), work.error)
        sessions = []
        for w in waiting:
            if w.session.closed or w.done:
                continue
            if w.cancelled:
                self._finish(w, p.FailCode.CANCELLED, "cancelled")
            elif isinstance(work.error, CorruptBlock):
                layer, expert = w.key
                self._finish(w, p.FailCode.CORRUPT,
                             f"layer {layer} expert {expert} of {self.pack.path} is corrupt: {work.error}; "
                             f"run expertpack verify {self.config.pack}")
            elif work.error is not None:
                self._finish(w, p.FailCode.IO_ERROR, f"read failed: {work.error}")
            else:
                self._ready_ram(w, slot)
            if w.session not in sessions:
                sessions.append(w.session)
        if work.session not in sessions:
            sessions.append(work.session)
        for session in sessions:
            self._dispatch(session)

    def _finish(self, work: Work, fail: p.FailCode | None, message: str, ready: p.Ready | None = None) -> None:
        """Answers one key exactly once and retires its request when it was the last."""
        work.done = True
        session = work.session
        session.queued -= 1
        if work.ram and ready is None:
            session.ram_taken -= 1  # a FAIL: no hold after all (a READY's ends at its RELEASE)
        if ready is not None:
            self.counters.ready += 1
            session.counters.ready += 1
            session.counters.served_bytes += ready.nbytes
            if work.prio == p.Priority.DEMAND:
                session.counters.demand_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
            self._send(session.identity, ready)
        else:
            self.counters.failed += 1
            session.counters.failed += 1
            self.counters.cancelled += fail is p.FailCode.CANCELLED
            self._send(session.identity, p.Fail(work.request_id, work.key, fail, message[:p.MAX_TEXT]))
        request = session.requests.get(work.request_id)
        if request is not None:
            request.open -= 1
            if request.open == 0:
                del session.requests[work.request_id]

    # ---- clients -----------------------------------------------------------------------------
    def _drain_monitor(self) -> None:
        """Connection events: a closed connection (process gone, heartbeat timeout) ends its session."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            # Only the connection that said HELLO ends its session (a connection that lost the
            # routing id to another one closes after that one has taken it). Found by the session's
            # own fd, not by who sent last on that fd: a closed connection's messages still queued
            # carry its fd, which a new connection may have by the time they are read.
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._forget_fd(fd)
                self._accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._forget_fd(fd)
                self._open_fds.pop(fd, None)
                for identity in [i for i, s in self.sessions.items() if s.fd == fd]:
                    self._drop(identity, "disconnected")

    def _end_silent_sessions(self) -> None:
        """Liveness (protocol v4): a session whose connection has sent nothing, not even HEARTBEAT,
        for heartbeat_timeout_s ends, and its slots go to the clients that are alive. The client
        is told why by an unasked ERROR NO_SESSION, which it reads if it ever runs again."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.config.heartbeat_interval_s)
        timeout_s = self.config.heartbeat_timeout_s
        for identity, session in [(i, s) for i, s in self.sessions.items() if now - s.heard > timeout_s]:
            why = (f"silent for {now - session.heard:.1f} s, more than heartbeat_timeout_s = {timeout_s:g} s: "
                   "its slots went to other clients")
            self.counters.clients_silent += 1
            self._drop(identity, why)
            message = f"expertd ended this client's session: {why}; say HELLO again"
            self._send(identity, p.Error(p.ErrorCode.NO_SESSION, message[:p.MAX_TEXT]))

    def _drop(self, identity: bytes, why: str) -> None:
        """Ends a session: queued keys vanish, leased slots return (a slot being read returns when
        its read completes)."""
        session = self.sessions.pop(identity, None)
        if session is None:
            return
        if why != "said HELLO again":
            self._gone[identity] = why
            if len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)
        session.closed = True
        session.free.clear()
        session.pending = (deque(), deque())
        self.counters.clients_dropped += why != "said HELLO again"
        for i in session.slots:
            slot = self.staging.pool.slots[i]
            if slot.state is SlotState.READING:
                continue
            if slot.state is not SlotState.FREE:
                slot.move(SlotState.FREE)
            self.staging.pool.give_back(i)
        held = sum(session.ram_holds.values())
        for i, n in list(session.ram_holds.items()):
            self._unhold(session, i, n)
        log.info("client %r (pid %s) %s: %d slots back, %d RAM tier holds ended", session.name,
                 session.pid if session.pid is not None else "unknown", why, len(session.slots), held)

    def _send(self, identity: bytes, msg: p.Message) -> None:
        try:
            self.router.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: gone; EAGAIN: not reading its socket
            if identity in self.sessions:
                self._drop(identity, f"unreachable ({exc.strerror})")

    def _error(self, identity: bytes, code: p.ErrorCode, message: str) -> None:
        self.counters.protocol_errors += 1
        log.debug("ERROR %s to %r: %s", code.name, identity, message)
        self._send(identity, p.Error(code, message[:p.MAX_TEXT]))

    # ---- stats and shutdown ------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.staging.pool
        return {
            "uptime_s": time.monotonic() - self.started,
            "pid": os.getpid(),
            "fingerprint": self.manifest.fingerprint,
            "arch": self.manifest.model.arch,
            "direct_io": self.pack.direct,
            # The pack as it is now: a file truncated or replaced under the daemon shows here before
            # a read fails on it.
            "pack": {"size_bytes": os.fstat(self.pack.fd).st_size, "manifest_size_bytes": self.manifest.pack_size_bytes,
                     "same_file": _same_file(self.pack.fd, self.pack.path)},
            "config": self.config.to_dict(),
            "counters": self.counters.to_dict(),
            "read_latency_us": self.read_latency.to_dict(),
            "fetch_latency_us": self.fetch_latency.to_dict(),
            "queue_depth": {"keys": sum(s.queued for s in self.sessions.values()), "reads": self.readers.queued},
            "slots": {"total": len(pool.slots), "unleased": pool.n_unleased, "slot_bytes": self.staging.slot_bytes,
                      **{state.value: pool.count(state) for state in SlotState}},
            "ram": {"slots": self.ram.n_slots, "first_slot": self.ram.first_slot,
                    "size_bytes": self.ram.n_slots * self.staging.slot_bytes, "budget": self.ram_why,
                    "resident_bytes": self.ram.resident_bytes, "held": self.ram.held,
                    "locked": self.staging.ram_locked, "lock_error": self.staging.ram_lock_error,
                    "hits": self.counters.ram_hits, "misses": self.counters.ram_misses,
                    "evictions": self.counters.ram_evictions,
                    **{state.value: self.ram.count(state) for state in RamState}},
            "clients": [self._client_stats(s) for s in self.sessions.values()],
        }

    def _client_stats(self, s: Session) -> dict:
        """One client's line of STATS: who it is, what it holds and waits for now, and its counters
        since HELLO (README, "Several workers on one expertd")."""
        return {"name": s.name, "pid": s.pid, "connected_s": time.monotonic() - s.connected,
                "slots": len(s.slots), "free": len(s.free), "queued": s.queued,
                "queue_entries": len(s.pending[0]) + len(s.pending[1]),
                "queued_demand": sum(not w.done for w in s.pending[0]),
                "queued_prefetch": sum(not w.done for w in s.pending[1]),
                "requests": len(s.requests), "ram_held": sum(s.ram_holds.values()), "ram_share": s.ram_share,
                "ram_reads": s.ram_reads,
                **s.counters.to_dict()}

    def _shutdown(self) -> None:
        notify("STOPPING=1")
        self.stopping = True
        for session in list(self.sessions.values()):
            for queue_ in session.pending:
                while queue_:
                    work = queue_.popleft()
                    if not work.done:
                        self._finish(work, p.FailCode.SHUTDOWN, "expertd is shutting down")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._in_flight() and time.monotonic() < deadline:
            self._drain_completions()
            time.sleep(0.001)
        for identity in list(self.sessions):
            self._send(identity, p.Bye("expertd is shutting down"))
        self.close()
        log.info("stopped: %d keys served, %s read", self.counters.ready, f"{self.counters.pack_read_bytes:,} B")

    def _in_flight(self) -> bool:
        return (any(s.state is SlotState.READING for s in self.staging.pool.slots)
                or any(s.state is RamState.READING for s in self.ram.slots))

    def close(self) -> None:
        """Releases everything the daemon created (socket and its ipc file, readers, staging, pack);
        safe to call twice and on a half-built daemon."""
        if self._closed:
            return
        self._closed = True
        router = getattr(self, "router", None)
        if getattr(self, "monitor", None) is not None:
            router.disable_monitor()
            self.monitor.close(0)
        if router is not None:
            router.close()
            if self.config.endpoint.startswith("ipc://"):
                path = Path(self.config.endpoint.removeprefix("ipc://"))
                if self._socket_inode is not None and _inode(path) == self._socket_inode:
                    path.unlink()  # ours; whatever another process put there since is left alone
        if self._lock_fd is not None:
            _lock_path(Path(self.config.endpoint.removeprefix("ipc://"))).unlink(missing_ok=True)  # still held
            os.close(self._lock_fd)
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()
        if getattr(self, "readers", None) is not None:
            self.readers.stop()
        if getattr(self, "staging", None) is not None:
            self.staging.close()
        if getattr(self, "_wake", None) is not None:
            os.close(self._wake)
        self.pack.close()


def _sender_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process that sent `frame` over ipc: libzmq records the peer's credentials
    (SO_PEERCRED) when a connection is accepted and attaches them to every message of that
    connection as its Peer-Address, "localhost:UID:GID:PID" (a tcp peer's is its IP address: None).
    Unlike ZMQ_SRCFD, it stays the sender's after the connection closed and its fd was reused."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    host, _, rest = address.partition(":")
    pid = rest.rpartition(":")[2]
    return int(pid) if host == "localhost" and rest.count(":") == 2 and pid.isdigit() and int(pid) > 0 else None


def _peer_pid(fd: int) -> int | None:
    """The process at the other end of an ipc connection (SO_PEERCRED), so that `expertctl stats`
    tells apart workers that gave the same name; None for tcp peers, or when the connection is gone
    by now. libzmq's I/O thread owns the fd: this asks through a duplicate (closed here) and never
    touches the original."""
    if fd < 0:
        return None
    try:
        with socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) != socket.AF_UNIX:
                return None
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
    except OSError:
        return None
    return pid if pid > 0 else None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open at `fd` (not deleted, not replaced)."""
    try:
        st = path.stat()
    except OSError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)


def _inode(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the socket file at `path`, or None when nothing or something else is there."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".lock")


def _lock_endpoint(socket_path: Path) -> int:
    """Takes the flock that makes this the only expertd between checking `socket_path` and
    removing it at exit: two daemons started at once on one endpoint would otherwise each take the
    other's fresh socket for a stale one. The lock file is removed at exit while still held, so a
    waiter that opened the old file retries on the new one."""
    lock = _lock_path(socket_path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"{lock}: cannot create expertd's lock file next to the socket ({exc.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != 0:
            os.close(fd)
            raise ValueError(f"{lock} exists and is not an expertd lock file (an empty file); choose another "
                             "--endpoint, or move the file away")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"ipc://{socket_path}: another expertd is serving (or starting) on {socket_path} "
                             f"(it holds {lock})") from None
        try:
            current = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino):
            return fd
        os.close(fd)  # the holder removed it as it exited: take the new one


def _remove_stale_socket(path: Path) -> None:
    """Removes the unix socket a killed expertd left at `path`. Only a socket nobody answers is
    removed: a live one, or anything that is not a socket (a pack file named by mistake), is an
    error naming the path and nothing is touched."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{path} exists and is not a socket; expertd binds a socket there and never removes "
                         f"other files: choose another --endpoint, or move the file away")
    if _someone_listens(path):
        raise ValueError(f"ipc://{path}: another expertd is serving on {path}")
    log.warning("removing %s, a socket left by an expertd that is gone", path)
    path.unlink()


def _someone_listens(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (a socket file left by a
    killed daemon refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except ConnectionRefusedError:
        return False
    except OSError as exc:
        raise ValueError(f"{path} exists and is not a socket expertd can replace ({exc.strerror})") from None
    finally:
        probe.close()
