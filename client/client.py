"""The Python client of expertd. Stable API (ops scripts and the worker use it):

    with ExpertClient("ipc:///run/expertpack/expertd.sock") as c:
        for expert in c.fetch([(3, 17), (3, 99)]):
            use(expert.key, expert.data)   # read-only memoryview of the payload, in shared staging
            expert.release()               # the slot goes back to the daemon

Experts arrive in completion order, not request order. `data` is valid until `release()`. The client
holds a fixed set of staging slots (leased at HELLO); a fetch of more keys than that proceeds as
experts are released. No GPU needed: the worker adds CUDA registration on top.

`submit(key)` sends a one-key FETCH (a prefetch, by default) without waiting: its answer is kept
for the returned Pending whenever the client reads its socket (during another fetch, or `pump()`),
and taken with `Pending.result()`. `Pending.cancel()` gives its slot back: at once when the answer
is in, otherwise with a CANCEL, and the late answer (a READY whose read had started) is released
as it arrives; a fetch left early (or failed) cancels the rest of its keys the same way.
`abandoned` counts the answers of cancelled requests still to come, which may each hold a slot.

A daemon that goes away is noticed at once, not after `timeout_s`: a BYE (it is shutting down), or
the connection closing under the session (it exited, was killed or restarted: a ZeroMQ socket
monitor reports the disconnect) raise DaemonUnavailable from the call waiting on it. The session
is then dead (the daemon dropped its leases with the connection); a new ExpertClient starts
another. `timeout_s` bounds only a daemon that keeps its connection but stops answering.
Liveness (protocol v4): a thread of the client sends HEARTBEAT whenever the session has sent
nothing for the interval WELCOME names, so a caller busy computing (or idle) keeps its session,
and a frozen one (SIGSTOP, a hung host) loses it `heartbeat_timeout_ms` after its last message.
Every use of the socket holds one lock (a ZeroMQ socket may change threads only behind a memory
barrier); the thread never waits for it: a caller inside a call beats from its own wait. A client
that finds, when it runs again, that it was silent longer than the timeout knows its session is
gone (the daemon dropped it and may have leased its slots to others) and raises DaemonUnavailable."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import zmq

from expertpack.packtools.layout import ExpertKey

from . import protocol as p
from .errors import ClientError, DaemonError, DaemonUnavailable, FetchFailed, FingerprintMismatch
from .ipc import PERMISSION_HINT, ipc_problem, map_staging, may_connect

DEFAULT_ENDPOINT = "ipc:///run/expertpack/expertd.sock"
# ZMTP heartbeats this client sends: a PING every second, and 10 s without a PONG tell the client
# that the daemon is frozen. They carry no TTL: the daemon's rule for a silent client is protocol
# v4's HEARTBEAT (README "Liveness").
ZMTP_HEARTBEAT_INTERVAL_MS = 1000
ZMTP_HEARTBEAT_TIMEOUT_MS = 10_000


class Expert:
    """One delivered expert: its key, the staging slot holding it, and its payload bytes."""

    __slots__ = ("key", "slot", "nbytes", "_client", "_data")

    def __init__(self, client: "ExpertClient", key: ExpertKey, slot: int, nbytes: int, data: memoryview) -> None:
        self.key = key
        self.slot = slot
        self.nbytes = nbytes
        self._client = client
        self._data: memoryview | None = data

    @property
    def data(self) -> memoryview:
        if self._data is None:
            raise ClientError(f"expert {tuple(self.key)} was released; its slot may hold another expert now")
        return self._data

    @property
    def released(self) -> bool:
        return self._data is None

    @property
    def client(self) -> "ExpertClient":
        """The session that leased the slot (a reconnect starts another)."""
        return self._client

    def release(self) -> None:
        """Gives the slot back; idempotent."""
        if self._data is not None:
            self._data.release()
            self._data = None
            self._client._release([self.slot])

    def __repr__(self) -> str:
        return f"Expert(key={tuple(self.key)}, slot={self.slot}, nbytes={self.nbytes})"


def release_all(experts: Iterable[Expert]) -> None:
    """Gives back the slots of `experts` (those not released yet) with one RELEASE per session,
    where each release() sends its own: a streaming worker gives back a slot for every miss."""
    by_client: dict[ExpertClient, list[int]] = {}
    for expert in experts:
        if expert._data is not None:
            expert._data.release()
            expert._data = None
            by_client.setdefault(expert._client, []).append(expert.slot)
    for client, slots in by_client.items():
        client._release(slots)


class Pending:
    """One key's FETCH, sent by ExpertClient.submit without waiting for its answer. Exactly one of
    result() (the caller then owns the Expert) or cancel() ends it."""

    __slots__ = ("client", "key", "request_id", "prio")

    def __init__(self, client: "ExpertClient", key: ExpertKey, request_id: int, prio: p.Priority) -> None:
        self.client = client
        self.key = key
        self.request_id = request_id
        self.prio = prio

    @property
    def answered(self) -> bool:
        """Whether its READY or FAIL has been read (by any read of the socket so far)."""
        inbox = self.client._inbox.get(self.request_id)
        return inbox is not None and bool(inbox)

    def result(self, timeout_s: float | None = None) -> Expert:
        """The expert, waiting for it if need be; FetchFailed when expertd answered FAIL."""
        if self.request_id not in self.client._inbox:
            raise ClientError(f"{self!r} was already taken or cancelled")
        msg = self.client._next_for(self.request_id, timeout_s)  # on a timeout it stays pending: cancel() it
        del self.client._inbox[self.request_id]
        if isinstance(msg, p.Fail):
            raise FetchFailed(msg.key, msg.code, msg.message)
        assert isinstance(msg, p.Ready)
        return self.client._expert(msg)

    def promote(self) -> None:
        """The key is needed now: expertd reads it at DEMAND priority if it has not answered yet
        (protocol v5). Nothing to do once its answer is in, taken or cancelled."""
        inbox = self.client._inbox.get(self.request_id)
        if inbox is None or inbox or self.prio is p.Priority.DEMAND:
            return
        self.prio = p.Priority.DEMAND
        self.client._send_if_alive(p.Promote(self.request_id))

    def cancel(self) -> None:
        """Gives up the key: an answer already in is released now; otherwise expertd is asked to
        cancel, and its answer (FAIL CANCELLED, or the READY of a read already started) is
        released when it arrives. Idempotent."""
        client = self.client
        inbox = client._inbox.pop(self.request_id, None)
        if inbox is None:
            return
        if inbox:
            msg = inbox.popleft()
            if isinstance(msg, p.Ready):
                client._release([msg.slot])
            return
        client._abandoned[self.request_id] = 1
        client._send_if_alive(p.Cancel(self.request_id))

    def __repr__(self) -> str:
        return f"Pending(key={tuple(self.key)}, id={self.request_id}, prio={self.prio.name})"


class ExpertClient:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, name: str | None = None, timeout_s: float = 30.0,
                 expect_fingerprint: str | None = None, curve_server_key: bytes | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        # The process-wide context: it is never terminated, so a client dropped without close()
        # (an exception, a forgotten `with`) cannot hang the interpreter in Context.term().
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # expertd sends no ZMTP heartbeats (libzmq issue 4841); ours find a frozen daemon.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_INTERVAL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        # Every use of the socket, from the caller or the heartbeat thread; reentrant because a
        # wait hands abandoned slots back from inside itself.
        self._lock = threading.RLock()
        self._last_sent = time.monotonic()
        self._beat_s = 0.0  # WELCOME's heartbeat interval; 0 until then, or when the daemon has none
        self._silence_limit_s = 0.0
        self.condemned: set[int] = set()  # RAM slots it keeps whose blocks failed expertd's scrub (CONDEMNED, v8)
        self._silenced = False  # this client was silent past the timeout: its session is gone
        self._stop_beating = threading.Event()
        self._beater: threading.Thread | None = None
        if endpoint.startswith("tcp://"):
            if curve_server_key is None:
                raise ClientError(f"{endpoint}: expertd refuses plain TCP; pass curve_server_key (its public key)")
            public, secret = zmq.curve_keypair()
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if endpoint.startswith("ipc://") and not may_connect(endpoint.removeprefix("ipc://")):
            self._sock.close(linger=0)
            raise ClientError(f"expertd at {endpoint}: {PERMISSION_HINT.format(path=endpoint.removeprefix('ipc://'))}")
        # Only the disconnect of an established connection: connect retries while no daemon is
        # there yet are ZeroMQ's business (a HELLO waits for the daemon to come).
        self._monitor: zmq.Socket | None = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._lost: str | None = None  # why the session died, once it has
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._inbox: dict[int, deque[p.Message]] = {}
        # Cancelled requests (a submit, a fetch left early) -> their answers not arrived yet
        self._abandoned: dict[int, int] = {}
        self._map: mmap.mmap | None = None
        try:
            self._send(p.Hello(p.PROTOCOL_VERSION, name or f"pid-{os.getpid()}", expect_fingerprint or ""))
            try:
                welcome = self._expect(p.Welcome, "HELLO")
            except DaemonError as exc:
                if exc.code is p.ErrorCode.FINGERPRINT:
                    raise FingerprintMismatch(str(exc)) from None
                raise
            self.welcome = welcome
            # The daemon heard HELLO just now, however long it waited in ZeroMQ's queue for a daemon
            # to come: the session's silence starts here, not when HELLO was queued.
            self._last_sent = time.monotonic()
            self._map = map_staging(welcome.shm, welcome.shm_bytes)
            if welcome.heartbeat_interval_ms:
                self._beat_s = welcome.heartbeat_interval_ms / 1000
                self._silence_limit_s = welcome.heartbeat_timeout_ms / 1000
                self._beater = threading.Thread(target=_beat_loop, args=(weakref.ref(self), self._stop_beating,
                                                                         self._beat_s / 2),
                                                name="expertd-heartbeat", daemon=True)
                self._beater.start()
        except BaseException:
            self.close()
            raise

    # ---- the API -----------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.welcome.fingerprint

    @property
    def model(self) -> dict[str, Any]:
        return self.welcome.model

    @property
    def slots(self) -> tuple[int, ...]:
        return self.welcome.slots

    @property
    def staging(self) -> mmap.mmap:
        """The whole shared staging segment, read-only (the worker registers it with CUDA, read-only
        too)."""
        assert self._map is not None
        return self._map

    def fetch(self, keys: Iterable[tuple[int, int]], prio: p.Priority = p.Priority.DEMAND,
              timeout_s: float | None = None, on_sent: Callable[[], None] | None = None) -> Iterator[Expert]:
        """Yields every requested expert as it arrives. Raises FetchFailed on the first key expertd
        cannot deliver (the rest of the request is cancelled). Leaving the loop early cancels too.
        `on_sent` runs once the FETCH is sent, before the first wait (what to ask for behind it)."""
        wanted = [ExpertKey(int(l), int(e)) for l, e in keys]
        if not wanted:
            if on_sent is not None:
                on_sent()
            return
        request_id = next(self._ids)
        self._inbox[request_id] = deque()
        self._send(p.Fetch(request_id, tuple(wanted), prio))
        remaining = len(wanted)
        try:
            if on_sent is not None:  # inside: whatever it raises, this request is cancelled below
                on_sent()
            while remaining:
                msg = self._next_for(request_id, timeout_s)
                remaining -= 1
                if isinstance(msg, p.Fail):
                    raise FetchFailed(msg.key, msg.code, msg.message)
                assert isinstance(msg, p.Ready)
                yield self._expert(msg)
        finally:
            # Experts that arrived for this fetch but were never handed out go straight back; the
            # answers still to come are released as they arrive (settle() waits for them).
            inbox = self._inbox.pop(request_id)
            unclaimed = [m.slot for m in inbox if isinstance(m, p.Ready)]
            if unclaimed:
                self._release(unclaimed)
            if remaining > len(inbox):
                self._abandoned[request_id] = remaining - len(inbox)
                self._send_if_alive(p.Cancel(request_id))

    def submit(self, key: tuple[int, int], prio: p.Priority = p.Priority.PREFETCH) -> Pending:
        """Sends a FETCH of one key and returns at once (see Pending)."""
        request_id = next(self._ids)
        self._inbox[request_id] = deque()
        pending = Pending(self, ExpertKey(int(key[0]), int(key[1])), request_id, prio)
        self._send(p.Fetch(request_id, (pending.key,), prio))
        return pending

    def pump(self) -> None:
        """Reads whatever expertd has sent by now, without waiting: answers go to their requests
        (a submit's, a cancelled one's: released). DaemonUnavailable once the session is known
        gone (this client was silent past the heartbeat timeout), DaemonError for an ERROR."""
        with self._lock:  # the heartbeat thread sends on this socket
            while (msg := self._recv_locked(0, wait=False)) is not None:
                if isinstance(msg, p.Error):
                    raise DaemonError(msg.code, msg.message)
                self._route(msg)

    @property
    def abandoned(self) -> int:
        """Answers of cancelled requests not arrived yet: each may still hold one of the client's slots."""
        return sum(self._abandoned.values())

    def settle(self, timeout_s: float | None = None) -> None:
        """Waits until every cancelled request has its answers (and their slots are back)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while self._abandoned:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, p.Error):
                raise DaemonError(msg.code, msg.message)
            self._route(msg)

    def stats(self) -> dict[str, Any]:
        self._send(p.Stats())
        return self._expect(p.StatsReply, "STATS").stats

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._send(p.Ping())
        self._expect(p.Pong, "PING")
        return time.perf_counter() - start

    def close(self) -> None:
        self._stop_beating.set()
        if self._beater is not None:
            self._beater.join()
            self._beater = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # an Expert still holds a view; the mapping goes when it does
            self._map = None
        if self._monitor is not None:
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=0)

    def __enter__(self) -> "ExpertClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------
    def _expert(self, msg: p.Ready) -> Expert:
        view = memoryview(self.staging)[msg.slot * self.welcome.slot_bytes:][:msg.nbytes]
        return Expert(self, msg.key, msg.slot, msg.nbytes, view)

    def silenced(self) -> bool:
        """Whether this client has been silent longer than the daemon's heartbeat timeout (the
        process was stopped): its session is gone and its staging slots may hold other clients'
        experts, so bytes copied out of them since the last message sent cannot be trusted."""
        with self._lock:
            self._check_silence()
            return self._silenced

    def _release(self, slots: list[int]) -> None:
        self._send_if_alive(p.Release(tuple(slots)))

    @property
    def ram_keeps(self) -> int:
        """How many RAM tier blocks this session may keep (v8; 0: none)."""
        return self.welcome.ram_keeps

    def keep(self, experts: list[Expert]) -> None:
        """KEEP (v8): the holds of these experts (delivered from RAM tier slots, not released) are
        kept: the caller reads their bytes in place for as long as it likes and releases them when
        done (release() or release_all, as any other); they count against `ram_keeps`, no longer
        against the holds its fetches may take."""
        if any(e._client is not self or e.released for e in experts):
            raise ClientError("only this session's experts, not released, can be kept")
        if experts:
            self._send_if_alive(p.Keep(tuple(e.slot for e in experts)))

    def _send_if_alive(self, msg: p.Message) -> None:
        """RELEASE and CANCEL: a closed or dead session has nothing left to give back (the daemon
        dropped its leases and requests with the connection)."""
        with self._lock:
            if not self._sock.closed and not self._disconnected():
                self._put(msg)

    def _send(self, msg: p.Message) -> None:
        with self._lock:
            if self._disconnected():
                return  # nobody holds this session any more: the reply's wait raises (after reading any BYE)
            self._put(msg)

    def _put(self, msg: p.Message) -> None:
        self._sock.send(p.encode(msg))
        self._last_sent = time.monotonic()

    def _beat_turn(self) -> bool:
        """One turn of the heartbeat thread; False once the socket is closed. It skips the turn
        while the caller holds the socket (a wait beats by itself)."""
        if not self._lock.acquire(blocking=False):
            return True
        try:
            if self._sock.closed:
                return False
            self._beat_if_due()
            return True
        finally:
            self._lock.release()

    def _beat_if_due(self) -> None:
        """Under the lock: HEARTBEAT once the session has sent nothing for an interval."""
        if self._beat_s and not self._disconnected() and time.monotonic() - self._last_sent >= self._beat_s:
            self._put(p.Heartbeat())

    def _check_silence(self) -> None:
        """A silence longer than the daemon's timeout (this process was stopped, or starved) means
        the session is gone, whatever the socket says; nothing may be sent or handed out then."""
        if not self._beat_s or self._lost is not None:
            return
        silent_s = time.monotonic() - self._last_sent
        if silent_s > self._silence_limit_s:
            self._silenced = True
            self._lost = (f"this client sent nothing to expertd at {self.endpoint} for {silent_s:.1f} s (was the "
                          f"process stopped?), more than its heartbeat timeout of {self._silence_limit_s:g} s: the "
                          "daemon has ended the session and its slots may hold other clients' experts now")

    def _disconnected(self) -> bool:
        """True once the session is gone: the connection to the daemon closed under it, or this
        client was silent past the heartbeat timeout (seen without waiting)."""
        self._check_silence()
        if self._lost is None and self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()  # the event itself says no more than "disconnected"
            self._lost = (f"expertd at {self.endpoint} closed the connection (it exited, was killed or is "
                          "restarting) and no longer knows this client: the session's leases and requests died "
                          "with it")
        return self._lost is not None

    def _recv(self, timeout_s: float | None) -> p.Message:
        with self._lock:
            return self._recv_locked(timeout_s)

    def _recv_locked(self, timeout_s: float | None, wait: bool = True) -> p.Message | None:
        """The next message; without `wait`, None when none is there yet. A message already in is
        read without a poll: a streaming worker reads one or two for every miss."""
        # What the daemon sent before it went away is still good (a READY names bytes read whole into
        # a segment we keep mapped): the data socket is read first, the disconnect acted on once it is empty.
        self._check_silence()
        if self._silenced:
            raise DaemonUnavailable(self._lost)  # READYs still queued name slots that are no longer ours
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if not wait:
                    return None
                raw = self._wait_for_message(timeout_s)
            msg = p.decode(raw)
            if not isinstance(msg, p.Condemned):
                break
            self.condemned.update(msg.slots)  # unasked: blocks this client keeps failed expertd's scrub
        if isinstance(msg, p.Bye):
            raise DaemonUnavailable(f"expertd at {self.endpoint} is going away: {msg.reason}")
        if isinstance(msg, p.Error) and msg.code is p.ErrorCode.SHUTTING_DOWN:
            # On its way out (a restart, mostly): its successor may answer a new session.
            raise DaemonUnavailable(f"expertd at {self.endpoint} is shutting down: {msg.message}")
        if isinstance(msg, p.Error) and msg.code is p.ErrorCode.NO_SESSION:
            # The daemon ended the session (it was silent too long: the message says so), or a daemon
            # that restarted behind the same endpoint got a message of our old session.
            self._lost = f"expertd at {self.endpoint} no longer knows this client: {msg.message}"
            raise DaemonUnavailable(self._lost)
        return msg

    def _wait_for_message(self, timeout_s: float | None) -> bytes:
        """Waits for the daemon's next message, beating meanwhile; DaemonUnavailable when the
        session is gone or nothing came within the timeout."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._sock.poll(0):
            self._beat_if_due()
            if self._disconnected():
                raise DaemonUnavailable(self._lost)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                why = ipc_problem(self.endpoint) or "is it running? (systemctl status expertd)"
                raise DaemonUnavailable(f"no answer from expertd at {self.endpoint} within {timeout:g} s; {why}")
            poller.poll(min(left_ms, int(self._beat_s * 500) or left_ms))
        return self._sock.recv()

    def _expect(self, kind: type[p.Message], what: str) -> Any:
        """The reply to a request that has one (WELCOME, STATS_REPLY, PONG); key traffic that
        arrives meanwhile is kept for its fetch."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, p.Error):
                raise DaemonError(msg.code, msg.message)
            self._route(msg)

    def _next_for(self, request_id: int, timeout_s: float | None) -> p.Message:
        inbox = self._inbox[request_id]
        while not inbox:
            msg = self._recv(timeout_s)
            if isinstance(msg, p.Error):
                raise DaemonError(msg.code, msg.message)
            self._route(msg)
        return inbox.popleft()

    def _route(self, msg: p.Message) -> None:
        request_id = getattr(msg, "id", None)
        if request_id in self._inbox:
            self._inbox[request_id].append(msg)
            return
        left = self._abandoned.get(request_id)  # each key of a request has exactly one answer
        if left is not None:
            if left > 1:
                self._abandoned[request_id] = left - 1
            else:
                del self._abandoned[request_id]
        if isinstance(msg, p.Ready):  # for a fetch the caller abandoned: hand the slot straight back
            self._release([msg.slot])


def _beat_loop(ref: "weakref.ReferenceType[ExpertClient]", stop: threading.Event, period_s: float) -> None:
    """The heartbeat thread of one client. It holds the client only weakly, so that a client
    dropped without close() is still collected (and its thread ends)."""
    while not stop.wait(period_s):
        client = ref()
        if client is None or not client._beat_turn():
            return
        del client
