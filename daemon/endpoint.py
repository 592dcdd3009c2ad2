"""expertd's endpoint: the ROUTER socket, bound with the options the main loop relies on, and for
an ipc:// endpoint the socket file's life. One expertd per ipc endpoint from start to exit: a flock
on <socket>.lock is taken before a socket found there is judged stale, and at exit the socket file
is removed only while it is still the one this daemon bound, the lock file only if this daemon
made it (an empty one found there is used and left). A file that is not a socket, or a
socket some process answers on, is never removed: that is an error naming the path. A tcp://
endpoint is CurveZMQ only, with a ZAP handler that admits any client key and names it on each
message (User-Id), so that a client is its key (peers.py). Knows nothing of sessions or messages."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from expertpack.client import protocol as p

from .config import DaemonConfig

log = logging.getLogger("expertd")

RECV_HWM = 0  # unlimited: see Endpoint._bind


class Endpoint:
    """The bound ROUTER socket and, over ipc, the lock and the socket file that go with it. A bind
    that fails leaves nothing behind: no socket, no lock."""

    def __init__(self, ctx: zmq.Context, config: DaemonConfig, send_hwm: int) -> None:
        self.address = config.endpoint
        self._path = Path(self.address.removeprefix("ipc://")) if self.address.startswith("ipc://") else None
        self._socket_inode: tuple[int, int] | None = None  # the socket file this daemon bound, once bound
        self._lock_fd: int | None = None  # flock on <socket>.lock: one expertd per ipc endpoint, start to exit
        self._lock_made = False  # whether this daemon made the lock file (only then is it removed)
        self._zap: ThreadAuthenticator | None = None  # tcp: names each connection's CurveZMQ key
        try:
            self.router = self._bind(ctx, config, send_hwm)
        except BaseException:
            self._stop_zap()
            self._unlock()
            raise

    def _bind(self, ctx: zmq.Context, config: DaemonConfig, send_hwm: int) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A peer that connects with a routing id in use takes it over: libzmq otherwise keeps
            # every such ignored connection's pipes for the life of the socket (peers.py).
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, send_hwm)
            # libzmq 4.3.5 aborts (issue 4841) when it writes to a connection whose peer closed while
            # its receive pipe was stopped. An unlimited receive pipe never stops a live connection,
            # and with no ZMTP heartbeats of its own the daemon never writes to one on a timer.
            sock.setsockopt(zmq.RCVHWM, RECV_HWM)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
            # Up to 4x the protocol's limit arrives and gets ERROR TOO_LARGE; beyond, zmq drops the peer.
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * p.MAX_MESSAGE_BYTES)
            if self._path is None:
                assert config.curve_secret_key_file is not None
                public, secret = zmq.auth.load_certificate(str(config.curve_secret_key_file))
                if secret is None:
                    raise ValueError(f"{config.curve_secret_key_file} holds no secret key (make one with "
                                     "zmq.auth.create_certificates)")
                # Every key may connect (the server's key is the secret that matters); the handler
                # only makes libzmq name the client's key on its messages.
                self._zap = ThreadAuthenticator(ctx, log=log.getChild("zap"))
                self._zap.start()
                self._zap.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            else:
                _make_directory(self._path.parent)
                self._lock_fd, self._lock_made = _lock_endpoint(self._path)
                _remove_stale_socket(self._path)
            sock.bind(self.address)
            if self._path is not None:
                os.chmod(self._path, 0o660)  # group shared with workers
                self._socket_inode = _inode(self._path)
            return sock
        except BaseException:
            sock.close(0)  # an open socket would hang the context's term()
            raise

    def close(self) -> None:
        """Closes the socket and removes its file (if still ours: whatever another process put
        there since is left alone), then the lock."""
        self.router.close()
        self._stop_zap()
        if self._path is not None and self._socket_inode is not None and _inode(self._path) == self._socket_inode:
            self._path.unlink()
        self._unlock()

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            assert self._path is not None
            if self._lock_made:
                _lock_path(self._path).unlink(missing_ok=True)  # still held: see _lock_endpoint
            os.close(self._lock_fd)
            self._lock_fd = None


def _make_directory(directory: Path) -> None:
    """The socket's directory, made (with its parents) when missing, as `mkdir -p` would: systemd
    makes /run/expertpack (RuntimeDirectory=), a user's $XDG_RUNTIME_DIR/expertpack is made here.
    Group-readable like the socket (0660), so that workers in expertd's group reach it."""
    if directory.is_dir():
        return
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create {directory}, the directory of the endpoint's socket ({exc.strerror}); "
                         "create it, or choose another --endpoint") from None
    log.info("created %s for the endpoint's socket", directory)


def _inode(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the socket file at `path`, or None when nothing or something else is there."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".lock")


def _lock_endpoint(socket_path: Path) -> tuple[int, bool]:
    """Takes the flock that makes this the only expertd between checking `socket_path` and
    removing it at exit: two daemons started at once on one endpoint would otherwise each take the
    other's fresh socket for a stale one. Returns the locked fd and whether this call made the file.
    A file it made is removed at exit while still held, so a waiter that opened the old file retries
    on the new one; an empty file found there is used and left in place (it is not expertd's to remove)."""
    lock = _lock_path(socket_path)
    while True:
        made = True
        try:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                made = False
                fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # removed by the expertd that made it, between the two opens: make it now
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
            return fd, made
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
