"""The client's side of what it shares with expertd on one host: the ipc:// socket file (may this
user connect to it, and why does nobody answer there) and the shared staging segment in /dev/shm,
mapped read-only: what expertd owns (staging slots, RAM tier blocks shared by every client), only
expertd writes. Only the file system and the socket file: no ZeroMQ, no protocol."""

from __future__ import annotations

import mmap
import os
import socket
from pathlib import Path

from .errors import ClientError

SHM_DIR = Path("/dev/shm")
PERMISSION_HINT = ("permission denied on {path}: this user may not connect to expertd's socket (mode 0660); run "
                   "in expertd's group (SupplementaryGroups= in a unit, or usermod -aG GROUP USER)")


def may_connect(path: str) -> bool:
    """False when the socket exists but this user may not reach or write it (waiting cannot help);
    True otherwise, also when nothing is there yet (expertd may still be starting)."""
    try:
        os.stat(path)
    except PermissionError:
        return False  # a directory on the way is closed to us
    except OSError:
        return True
    return os.access(path, os.W_OK)


def ipc_problem(endpoint: str) -> str | None:
    """Why nobody answers at an ipc:// endpoint, found by connecting to its socket file the way
    ZeroMQ does: permission denied, no socket there, or a socket nobody accepts on (a daemon that
    is gone). None when a process accepts connections there (or the endpoint is not ipc://)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except PermissionError:
        return PERMISSION_HINT.format(path=path)
    except FileNotFoundError:
        return f"there is no socket at {path}: is expertd running, and is this its endpoint? (systemctl status expertd)"
    except ConnectionRefusedError:
        return f"the socket {path} refuses connections: the expertd that made it is gone (systemctl status expertd)"
    except OSError as exc:
        return f"cannot connect to {path}: {exc.strerror}"
    else:
        return None
    finally:
        probe.close()


def map_staging(name: str, size: int) -> mmap.mmap:
    """The staging segment WELCOME named, `size` bytes of it, shared and read-only (a write into it
    raises TypeError; CUDA registers it with cudaHostRegisterReadOnly)."""
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise ClientError(f"{path}: permission denied; run in expertd's group (the segment is 0640)") from None
    except FileNotFoundError:
        raise ClientError(f"{path}: staging segment not found; is expertd on this host?") from None
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
