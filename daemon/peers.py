"""Who is at the other end of each of expertd's connections, as far as the main loop must know: the
peer process of each open connection (SO_PEERCRED at accept) and of each message (its own
connection's record), or over tcp its CurveZMQ key, which routing id speaks on which connection,
and who is cut for flooding. A client is its process over ipc and its key over tcp (ClientId):
what the per-client caps count against, however many connections it opens.

A peer that connects with a routing id already in use takes it over (ROUTER_HANDOVER: libzmq
otherwise keeps every such ignored connection's pipes, ~20 kB each, for the life of the socket). The
connection taken over has no pipe left: if it sent more and then closed, libzmq would keep it, an fd
and some kB, until the daemon exits, so it is shut down at the first message that shows the
takeover. Only peers that choose their routing id do this; ExpertClient does not.
The daemon never stops reading a connection (endpoint.py, RCVHWM 0), so messages a peer sends
faster than the main loop reads them queue inside libzmq: a peer that keeps the loop saturated
while the heap grows (flood.py) has its connections cut, what it left queued is dropped unread, and
its process's new connections are cut on accept for FLOOD_BAN_S.
Connections are closed only by shutdown() of a duplicate of their fd (libzmq's I/O thread owns the
fd), which libzmq sees as the peer closing. Sessions are not kept here: a connection cut goes to
`on_cut` first, so that the server ends the sessions on it."""

from __future__ import annotations

import logging
import os
import socket
import struct
import select
import time
from typing import Callable, NamedTuple

import zmq

from .flood import FLOOD_BAN_S, Flooder, FloodGuard, anon_bytes
from .stats import Counters

log = logging.getLogger("expertd")


class ClientId(NamedTuple):
    """The client a connection belongs to, as far as expertd can tell: its process over ipc
    (SO_PEERCRED), its CurveZMQ public key over tcp (Z85), else the connection alone."""

    kind: str  # "process", "CurveZMQ key" or "connection"
    value: int | str

    def __str__(self) -> str:
        return {"process": "this client process (pid {})", "CurveZMQ key": "this client's CurveZMQ key ({:.8}...)",
                "connection": "this connection (fd {})"}[self.kind].format(self.value)


class Arrival(NamedTuple):
    """Who sent a message that is to be handled."""

    pid: int | None  # the sender process, as its connection recorded it or as the fd's holder; None over tcp
    late: bool  # its connection closed since and its fd is another process's now
    curve_key: str | None = None  # over tcp, the sender's CurveZMQ public key (Z85), as the ZAP handler named it

    def client(self, fd: int) -> ClientId:
        """Whom a session opened by this message belongs to (`fd`: its connection)."""
        if self.pid is not None:
            return ClientId("process", self.pid)
        if self.curve_key is not None:
            return ClientId("CurveZMQ key", self.curve_key)
        return ClientId("connection", fd)


class Peers:
    def __init__(self, counters: Counters, on_cut: Callable[[int], None]) -> None:
        self.counters = counters
        self._on_cut = on_cut  # a connection about to be cut for flooding: its sessions end
        self.flood = FloodGuard()
        self._open_fds: dict[int, int | None] = {}  # connections open now (monitor) -> the peer pid at accept
        # Connections cut for flooding, by fd, until the fd is another connection's: what they left
        # queued is read and dropped unread.
        self._cut: set[int] = set()
        self._banned: dict[int, float] = {}  # pid cut for flooding -> until when its new connections are cut
        # Which connection each routing id last came from, and back: a message under an id from
        # another fd is a takeover (ROUTER_HANDOVER), and the connection it took the id from is closed.
        self._fd_of: dict[bytes, int] = {}
        self._id_on: dict[int, bytes] = {}

    # ---- the monitor's events ----------------------------------------------------------------
    def accepted(self, fd: int) -> None:
        """A new connection: its peer's pid noted; one of a process cut for flooding is cut at once."""
        self._forget_fd(fd)
        pid = peer_pid(fd)
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

    def disconnected(self, fd: int) -> None:
        self._forget_fd(fd)
        self._open_fds.pop(fd, None)

    # ---- messages ----------------------------------------------------------------------------
    def arrival(self, fd: int, frame: zmq.Frame) -> Arrival | None:
        """Who sent the message whose last frame is `frame`, read from connection `fd` (ZMQ_SRCFD);
        None when it is to be dropped unread (left queued by a connection cut for flooding)."""
        # The sender's pid as its own connection recorded it: a closed connection's messages still
        # queued carry its fd, which another process's connection may have by now.
        sender = sender_pid(frame)
        if fd in self._cut or (sender is not None and self._banned.get(sender, 0.0) > time.monotonic()):
            return None
        holder = self._open_fds.get(fd)
        late = sender is not None and holder is not None and sender != holder
        pid = sender if sender is not None else holder
        self.flood.seen(pid if pid is not None else ("connection", fd))
        return Arrival(pid, late, curve_key(frame) if pid is None else None)

    def note_connection(self, identity: bytes, fd: int) -> None:
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
            _shutdown_fd(previous)
            del self._id_on[previous]
        old_id = self._id_on.get(fd)
        if old_id is not None and self._fd_of.get(old_id) == fd:
            del self._fd_of[old_id]
        self._fd_of[identity] = fd
        self._id_on[fd] = identity

    def after_batch(self, backlogged: bool) -> None:
        """A batch of messages was read; `backlogged` when the socket still has more (saturated)."""
        flooder = self.flood.after_batch(anon_bytes() if backlogged else None)
        if flooder is not None:
            self._cut_peer(flooder)

    # ---- cutting -----------------------------------------------------------------------------
    def _forget_fd(self, fd: int) -> None:
        """A connection accepted or closed on `fd`: what was noted of the fd's previous connection goes."""
        identity = self._id_on.pop(fd, None)
        if identity is not None and self._fd_of.get(identity) == fd:
            del self._fd_of[identity]

    def _cut_peer(self, flooder: Flooder) -> None:
        """Closes the connections of a peer that outruns the main loop (flood.py), so that what it
        sends stops queueing in memory. Only connections the monitor says are open now, and over
        ipc only those whose peer is still the process that opened them (an fd may be another
        connection's by now)."""
        peer = flooder.peer
        if isinstance(peer, int):
            fds = [fd for fd, pid in self._open_fds.items() if pid == peer and peer_pid(fd) == peer]
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
        self._on_cut(fd)
        _shutdown_fd(fd)


def _shutdown_fd(fd: int) -> None:
    """Closes a connection under libzmq: shutdown() of a duplicate of its fd (libzmq's I/O thread
    owns the fd and closes it), seen by libzmq as the peer closing."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            conn.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        log.debug("shutdown of fd %d: %s", fd, exc)


def sender_pid(frame: zmq.Frame) -> int | None:
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


def curve_key(frame: zmq.Frame) -> str | None:
    """The CurveZMQ public key (Z85) of the tcp peer that sent `frame`: the User-Id that the ZAP
    handler (endpoint.py) gave its connection; None without one (ipc)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user or None


def connection_closed(fd: int) -> bool:
    """Whether the peer of connection `fd` has closed it, though libzmq may not have told the main
    loop yet (its socket monitor reports a close a little after it happens). Asked through a
    duplicate of the fd (libzmq's I/O thread owns it), without reading anything."""
    if fd < 0:
        return False
    try:
        dup = os.dup(fd)
    except OSError:
        return True
    try:
        poller = select.poll()
        poller.register(dup, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))
    finally:
        os.close(dup)


def peer_pid(fd: int) -> int | None:
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
