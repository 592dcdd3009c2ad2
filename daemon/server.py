"""expertd's main loop: one ZeroMQ ROUTER socket (endpoint.py), the reader pool's completions (an
eventfd) and the signal self-pipe, all polled by one thread that owns every piece of state
(sessions, requests, slots), so nothing here takes a lock. This module is the protocol's state
machine: each message is validated (one that fails gets ERROR and changes nothing), then HELLO
opens a session (sessions.py), FETCH queues keys that the scheduler (scheduler.py) reads or finds
in the RAM tier and answers, RELEASE gives slots and holds back, KEEP sets holds apart as kept
(read in place by the client's GPU), CANCEL and PROMOTE act on a
FETCH's keys not answered yet, and STATS, PING and HEARTBEAT change nothing.
A client that disconnects loses its leases: a session keeps the fd (ZMQ_SRCFD) of the connection
that said HELLO, the socket monitor reports a closed connection's fd, and that ends the sessions on
it; the monitor is drained before each message is handled, so a disconnect that came first is seen
first. A client that stays connected but sends nothing (frozen: SIGSTOP, a hung host) loses them
once heartbeat_timeout_s passes since its last message (protocol v4: clients send HEARTBEAT at
least every heartbeat_interval_s, which WELCOME names); it is told so by an unasked ERROR
NO_SESSION, read when it runs again. The daemon sends no ZMTP heartbeats and never stops reading a
connection (RCVHWM 0): libzmq 4.3.5 aborts (issue 4841, `!_io_error` in stream_engine_base.cpp)
when it writes, on a heartbeat timer or answering a peer's PING, to a connection whose peer closed
while its receive pipe was stopped. The cost: messages a peer sends faster than the main loop reads
them queue inside libzmq, about 80 MB per million small ones; so a peer that keeps the loop
saturated while the heap grows is cut (peers.py), and STATS, the one large answer, is answered
MAX_STATS_PER_S times a second per connection (flood.py). A session belongs to the connection that
said HELLO: a connection that takes its routing id over (peers.py) ends it, so it never inherits
that session's slots, and must say HELLO itself.
Several workers (one per GPU) share one daemon as so many clients: STATS reports each one's pid
(SO_PEERCRED of its ipc connection), what it holds and waits for, and its counters since HELLO."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from expertpack.client import protocol as p

from .config import DaemonConfig
from .endpoint import Endpoint
from .flood import StatsBudget
from .notify import notify, watchdog_interval_s
from .peers import Arrival, Peers, connection_closed
from .ram_tier import RamState, RamTier, ram_slot_count
from .reader import OpenPack, open_pack
from .scheduler import Scheduler
from .sessions import NoSlots, Session, Sessions
from .staging import SlotState, StagingSegment, lockable_bytes, remove_orphans
from .stats import Counters

log = logging.getLogger("expertd")

# Signals that stop expertd cleanly, as SIGTERM does: it has no reload, and any of these taking its
# default action (the process ends) would leave the shared memory and the socket behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MAX_QUEUED_KEYS = 4 * p.MAX_KEYS  # per client: pending + in flight
SEND_HWM = MAX_QUEUED_KEYS + 1024  # every queued key may end in one message
DRAIN_TIMEOUT_S = 10.0  # at shutdown, how long in-flight reads may take to finish


class ExpertDaemon:
    def __init__(self, config: DaemonConfig) -> None:
        assert config.pack is not None
        self.config = config
        self._closed = False
        self.pack: OpenPack = open_pack(config.pack, config.direct_io, config.read_splits)
        self.manifest = self.pack.manifest
        self.layers = {l.layer: l for l in self.manifest.layers}
        self.started = time.monotonic()
        self.counters = Counters()
        self.stats_budget = StatsBudget()
        self.peers = Peers(self.counters, on_cut=lambda fd: self.sessions.drop_on(fd, "cut for flooding"))
        self.stopping = False
        try:
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
            self.sessions = Sessions(config, self.staging, self.ram, self.counters, connection_closed)
            self.ctx = zmq.Context()
            self.endpoint = Endpoint(self.ctx, config, SEND_HWM)
            self.router = self.endpoint.router
            self.monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self.scheduler = Scheduler(config, self.pack, self.layers, self.staging, self.ram, self.counters, self._send)
            self.scheduler.on_condemned = self._tell_keepers
            self.scheduler.has_clients = lambda: bool(self.sessions.live)
        except BaseException:
            self.close()  # whatever was created so far: no shm or socket outlives a failed start
            raise

    # ---- main loop ---------------------------------------------------------------------------
    def serve(self) -> int:
        sig_r, sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous_fd = signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        caught: list[int] = []
        handlers = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in STOP_SIGNALS}
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.scheduler.wake, zmq.POLLIN)
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
                scrub_s = self.scheduler.scrub_wait_s(time.monotonic())
                if scrub_s is not None:
                    wait_s = min(wait_s, scrub_s)
                events = dict(poller.poll(max(1, round(wait_s * 1000))))
                if self.scheduler.wake in events:
                    self.scheduler.drain_completions()
                if self.monitor in events:
                    self._drain_monitor()
                if self.router in events:
                    self._drain_router()
                self._end_silent_sessions()
                self.scheduler.scrub(time.monotonic())
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
                self.peers.after_batch(False)
                return
            self._drain_monitor()  # disconnects that happened before this message come first
            identity = frames[0].bytes
            fd = frames[-1].get(zmq.SRCFD)
            arrival = self.peers.arrival(fd, frames[-1])
            if arrival is None:
                continue  # left queued by a connection cut for flooding (on an fd reused since, too): dropped unread
            session = self.sessions.live.get(identity)
            if not arrival.late:  # a late message says nothing of who holds its fd or its routing id now
                self.peers.note_connection(identity, fd)
                if session is not None and session.fd != fd:
                    self.sessions.drop(identity, "lost its routing id to another connection")
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
            if arrival.late and isinstance(msg, p.Hello):  # its client is gone: a session would hold slots for nobody
                log.debug("HELLO of pid %d read after its connection closed: no session", arrival.pid)
                continue
            self._handle(identity, msg, fd, arrival)
        self.peers.after_batch(bool(self.router.get(zmq.EVENTS) & zmq.POLLIN))

    def _drain_monitor(self) -> None:
        """Connection events: a closed connection (process gone, heartbeat timeout) ends its session."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            # Only the connection that said HELLO ends its session (a connection that lost the
            # routing id to another one closes after that one has taken it).
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.peers.accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.peers.disconnected(fd)
                self.sessions.drop_on(fd, "disconnected")

    def _end_silent_sessions(self) -> None:
        """A silent session ends, and its slots go to the clients that are alive. The client is told
        why by an unasked ERROR NO_SESSION, which it reads if it ever runs again."""
        for identity, why in self.sessions.silent():
            self.counters.clients_silent += 1
            self.sessions.drop(identity, why)
            message = f"expertd ended this client's session: {why}; say HELLO again"
            self._send(identity, p.Error(p.ErrorCode.NO_SESSION, message[:p.MAX_TEXT]))

    def _handle(self, identity: bytes, msg: p.Message, fd: int = -1, arrival: Arrival | None = None) -> None:
        if isinstance(msg, p.Ping):
            self._send(identity, p.Pong())
        elif isinstance(msg, p.Stats):
            if self.stats_budget.take(identity, time.monotonic()):
                self._send(identity, p.StatsReply(self.stats()))
            else:
                self._error(identity, p.ErrorCode.BUSY, f"at most {self.stats_budget.per_s} STATS a second per "
                            "connection: ask less often")
        elif isinstance(msg, p.Hello):
            self._hello(identity, msg, fd, arrival or Arrival(None, False))
        elif isinstance(msg, p.Heartbeat):
            return  # its arrival was the point (_drain_router); a late one of an ended session says nothing
        elif (session := self.sessions.live.get(identity)) is None:
            why = self.sessions.why_gone(identity)
            if why is not None and isinstance(msg, (p.Release, p.Cancel, p.Keep)):
                log.debug("%s from %r after its session ended: nothing to do", msg.op.name, identity)
                return
            self._error(identity, p.ErrorCode.NO_SESSION, f"{msg.op.name} before HELLO" if why is None else
                        f"{msg.op.name} from a client whose session ended ({why}); say HELLO again")
        elif isinstance(msg, p.Fetch):
            self._fetch(session, msg)
        elif isinstance(msg, p.Release):
            self._release(session, msg)
        elif isinstance(msg, p.Cancel):
            self._cancel(session, msg)
        elif isinstance(msg, p.Promote):
            self._promote(session, msg)
        elif isinstance(msg, p.Keep):
            self._keep(session, msg)
        else:
            self._error(identity, p.ErrorCode.UNKNOWN_OP, f"{msg.op.name} is sent by the daemon, not to it")

    # ---- requests ----------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: p.Hello, fd: int, arrival: Arrival) -> None:
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
        try:
            session = self.sessions.admit(identity, msg.client, msg.slots, fd, arrival.pid, arrival.client(fd))
        except NoSlots as exc:
            self._error(identity, p.ErrorCode.NO_SLOTS, str(exc))
            return
        m = self.manifest
        self._send(identity, p.Welcome(
            version=p.PROTOCOL_VERSION, fingerprint=m.fingerprint,
            model={"arch": m.model.arch, "n_layer": m.model.n_layer, "n_expert": m.model.n_expert,
                   "n_expert_used": m.model.n_expert_used, "moe_layers": list(m.model.moe_layers)},
            shm=self.staging.name, shm_bytes=self.staging.size_bytes, slot_bytes=self.staging.slot_bytes,
            slots=tuple(session.slots), ram_first_slot=self.ram.first_slot, ram_slots=self.ram.n_slots,
            ram_holds=session.ram_share, ram_keeps=session.ram_keeps, heartbeat_interval_ms=round(self.config.heartbeat_interval_s * 1000),
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
        self.scheduler.submit(session, msg.id, msg.keys, msg.prio)

    def _release(self, session: Session, msg: p.Release) -> None:
        refused = self.sessions.release(session, msg.slots)
        if refused is not None:
            self._error(session.identity, p.ErrorCode.BAD_FIELD, f"RELEASE.slots: {refused}")
            return
        self.scheduler.dispatch(session)

    def _tell_keepers(self, index: int) -> None:
        """CONDEMNED to every client keeping RAM slot `index`, whose block failed the scrub: its GPU
        reads kept blocks in place, past any check of ours, until it lets them go. A keeper a send
        fails to reach is dropped meanwhile (_send): the sessions are walked from a copy."""
        for session in list(self.sessions.live.values()):
            if not session.closed and session.ram_kept[index] > 0:
                log.warning("telling client %r (pid %s), which keeps RAM slot %d, to stop reading it", session.name,
                            session.pid, index)
                self._send(session.identity, p.Condemned((index,)))

    def _keep(self, session: Session, msg: p.Keep) -> None:
        refused = self.sessions.keep(session, msg.slots)
        if refused is not None:
            self._error(session.identity, p.ErrorCode.BAD_FIELD, f"KEEP.slots: {refused}")
            return
        condemned = tuple(sorted({i for i in msg.slots if self.ram.slot(i).state is RamState.CONDEMNED}))
        if condemned:  # the scrub found it altered between its READY and this KEEP: nobody told this client
            log.warning("telling client %r (pid %s), which keeps RAM slots %s condemned already, to stop reading them",
                        session.name, session.pid, list(condemned))
            self._send(session.identity, p.Condemned(condemned))
        self.scheduler.dispatch(session)  # its fetches have the room the kept holds took

    def _cancel(self, session: Session, msg: p.Cancel) -> None:
        request = session.requests.get(msg.id)
        if request is not None:  # else answered in full already: a cancel racing the last READY is no error
            self.scheduler.cancel(session, request)

    def _promote(self, session: Session, msg: p.Promote) -> None:
        request = session.requests.get(msg.id)
        if request is not None:  # else answered in full already: a promote racing the last READY is no error
            self.scheduler.promote(session, request)

    def _send(self, identity: bytes, msg: p.Message) -> None:
        try:
            self.router.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: gone; EAGAIN: not reading its socket
            self.sessions.drop(identity, f"unreachable ({exc.strerror})")

    def _error(self, identity: bytes, code: p.ErrorCode, message: str) -> None:
        self.counters.protocol_errors += 1
        log.debug("ERROR %s to %r: %s", code.name, identity, message)
        self._send(identity, p.Error(code, message[:p.MAX_TEXT]))

    # ---- stats and shutdown ------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.staging.pool
        sessions = self.sessions.live.values()
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
            "read_latency_us": self.scheduler.read_latency.to_dict(),
            "fetch_latency_us": self.scheduler.fetch_latency.to_dict(),
            "queue_depth": {"keys": sum(s.queued for s in sessions), "reads": self.scheduler.readers.queued},
            "slots": {"total": len(pool.slots), "unleased": pool.n_unleased, "slot_bytes": self.staging.slot_bytes,
                      **{state.value: pool.count(state) for state in SlotState}},
            "ram": {"slots": self.ram.n_slots, "first_slot": self.ram.first_slot,
                    "size_bytes": self.ram.n_slots * self.staging.slot_bytes, "budget": self.ram_why,
                    "resident_bytes": self.ram.resident_bytes, "held": self.ram.held,
                    "locked": self.staging.ram_locked, "lock_error": self.staging.ram_lock_error,
                    "hits": self.counters.ram_hits, "misses": self.counters.ram_misses,
                    "evictions": self.counters.ram_evictions,
                    **{state.value: self.ram.count(state) for state in RamState}},
            "clients": [s.stats() for s in sessions],
        }

    def _shutdown(self) -> None:
        notify("STOPPING=1")
        self.stopping = True
        for session in list(self.sessions.live.values()):
            for queue_ in session.pending:
                while queue_:
                    work = queue_.popleft()
                    if not work.done:
                        self.scheduler.finish(work, p.FailCode.SHUTDOWN, "expertd is shutting down")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.scheduler.in_flight() and time.monotonic() < deadline:
            self.scheduler.drain_completions()
            time.sleep(0.001)
        for identity in list(self.sessions.live):
            self._send(identity, p.Bye("expertd is shutting down"))
        self.close()
        log.info("stopped: %d keys served, %s read", self.counters.ready, f"{self.counters.pack_read_bytes:,} B")

    def close(self) -> None:
        """Releases everything the daemon created (socket and its ipc file, readers, staging, pack);
        safe to call twice and on a half-built daemon."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "monitor", None) is not None:
            self.router.disable_monitor()
            self.monitor.close(0)
        if getattr(self, "endpoint", None) is not None:
            self.endpoint.close()
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.close()
        if getattr(self, "staging", None) is not None:
            self.staging.close()
        self.pack.close()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open at `fd` (not deleted, not replaced)."""
    try:
        st = path.stat()
    except OSError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)
