"""Which peer to cut when one outruns expertd's main loop. expertd reads every connection without
a high-water mark (RCVHWM 0, libzmq issue 4841: see server.py), so messages a peer sends faster
than the loop handles them queue inside libzmq without a bound. The loop cannot see that queue,
but it sees its effect: the socket still has messages after every batch it reads (saturated), and
the daemon's anonymous memory (RssAnon: the heap, where libzmq queues; not the shared staging)
grows. Saturation alone is only full load (clients that wait for their answers keep the loop busy
without growing it much), so a peer is named once the heap has grown FLOOD_GROWTH_BYTES during
one unbroken saturation: the one that sent the most of what was read meanwhile (at least
FLOOD_MIN_MESSAGES), and the server cuts its connections. A peer is a process (its pid, over ipc,
as each message's own connection recorded it) so that a flood spread over many connections is one
flood; a tcp connection is a peer of its own.
A process that was cut has its new connections cut as they are accepted for FLOOD_BAN_S:
reconnecting at once would otherwise flood on, each connection until it is named.
STATS is the one request whose answer is large (kilobytes): a peer that asks faster than it reads
would have the daemon queue up to SNDHWM of them for it, so each connection gets MAX_STATS_PER_S
answers a second and ERROR BUSY beyond (StatsBudget). This module only counts; it knows nothing
of sockets."""

from __future__ import annotations

from collections import Counter
from typing import Hashable, NamedTuple

# Heap growth during one saturation that makes its top sender a flooder. Not all of it is queue:
# under the soak (2 fuzzers pacing themselves, 3,000 connections) a loaded 2-core machine grew the
# heap by 44 MiB in 5 s of saturation with nothing queued beyond ~800 messages (arenas, connections,
# decoded messages), and 48 MiB cut a fuzzer that played by the rules; a flood grows it ~75 MB a
# second, so 128 MiB still cuts one within two seconds.
FLOOD_GROWTH_BYTES = 128 << 20
FLOOD_MIN_MESSAGES = 1000  # the least a peer must have sent meanwhile to be cut: one batch
FLOOD_BAN_S = 30.0  # a process cut for flooding has every new connection cut at once this long
MAX_STATS_PER_S = 200  # STATS answered per connection and second; an ops tool or a health probe asks ~1


def anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon of /proc/self/status)."""
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no RssAnon line (Linux 4.5 or later has it)")


class Flooder(NamedTuple):
    peer: Hashable  # what the server counted the messages under (a pid, or a connection)
    messages: int  # what it sent of what the loop read while the heap grew


class FloodGuard:
    """Counts messages per peer during an unbroken saturation of the main loop, and names the top
    sender once the heap has grown FLOOD_GROWTH_BYTES since it began (or since the last cut)."""

    def __init__(self, growth_bytes: int = FLOOD_GROWTH_BYTES, min_messages: int = FLOOD_MIN_MESSAGES) -> None:
        self.growth_bytes = growth_bytes
        self.min_messages = min_messages
        self._baseline: int | None = None  # the heap when the current saturation began; None: not saturated
        self._counts: Counter[Hashable] = Counter()

    def seen(self, peer: Hashable) -> None:
        """One message read from `peer` (only counted while saturated)."""
        if self._baseline is not None:
            self._counts[peer] += 1

    def after_batch(self, heap_bytes: int | None) -> Flooder | None:
        """After each batch the loop read: the heap's size if messages were left behind, None if the
        socket was emptied. Names the peer to cut, or None."""
        if heap_bytes is None:
            self._baseline = None
            self._counts.clear()
            return None
        if self._baseline is None:
            self._baseline = heap_bytes
            return None
        if heap_bytes - self._baseline < self.growth_bytes:
            return None
        top = self._counts.most_common(1)
        self._baseline = heap_bytes  # what grew is counted once, whatever is decided
        self._counts.clear()
        if top and top[0][1] >= self.min_messages:
            return Flooder(*top[0])
        return None


class StatsBudget:
    """MAX_STATS_PER_S STATS replies per connection (routing id) in each second; forgets every id
    each second, so it holds at most a second's worth of them."""

    def __init__(self, per_s: int = MAX_STATS_PER_S) -> None:
        self.per_s = per_s
        self._second = -1
        self._used: dict[bytes, int] = {}

    def take(self, identity: bytes, now: float) -> bool:
        """Whether one more STATS of `identity` may be answered now."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._used.clear()
        used = self._used.get(identity, 0)
        if used >= self.per_s:
            return False
        self._used[identity] = used + 1
        return True
