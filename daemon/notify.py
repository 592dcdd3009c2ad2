"""systemd's notify protocol without libsystemd: one datagram per state change to $NOTIFY_SOCKET
(READY=1, STOPPING=1, WATCHDOG=1, STATUS=...). Does nothing when not started by systemd with
Type=notify, so the daemon runs the same by hand."""

from __future__ import annotations

import os
import socket


def notify(*states: str) -> bool:
    """Sends `states` (e.g. "READY=1", "STATUS=serving") as one message; False when there is no
    notify socket. Errors sending are swallowed: readiness must never take the daemon down."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(states).encode())
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC when systemd asked this process for watchdog pings, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
