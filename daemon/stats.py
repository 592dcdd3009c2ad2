"""expertd's counters and latency histograms, updated by the main loop only (no locks), reported by
STATS. Histograms use power-of-two microsecond buckets: constant memory, percentiles good to a
factor of two, which is what an operator needs to see a slow disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

N_BUCKETS = 40  # 1 us .. 2^39 us (6 days)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    total: int = 0
    sum_us: float = 0.0

    def add_ns(self, ns: int) -> None:
        us = max(1, ns // 1000)
        self.counts[min(N_BUCKETS - 1, us.bit_length() - 1)] += 1
        self.total += 1
        self.sum_us += ns / 1000

    def percentile_us(self, q: float) -> float:
        """Upper edge of the bucket holding the q-quantile (0 when empty)."""
        if not self.total:
            return 0.0
        need = q * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need:
                return float(2 ** (i + 1))
        return float(2 ** N_BUCKETS)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.total, "mean": self.sum_us / self.total if self.total else 0.0,
                "p50": self.percentile_us(0.5), "p99": self.percentile_us(0.99), "buckets_log2_us": list(self.counts)}


@dataclass
class Counters:
    fetches: int = 0  # FETCH messages accepted
    keys: int = 0  # keys asked for
    ready: int = 0  # READY sent
    failed: int = 0  # FAIL sent (io errors, cancels, shutdown)
    cancelled: int = 0
    pack_read_bytes: int = 0
    read_ops: int = 0
    io_errors: int = 0
    # blocks read whole whose crc32 did not match the manifest's (FAILed CORRUPT), and RAM tier blocks
    # found altered in memory at a hit (read again from the pack)
    corrupt_blocks: int = 0
    checked_blocks: int = 0  # blocks whose crc32 was checked (0 for a pack built before format 1.1)
    checked_bytes: int = 0
    fallback_count: int = 0  # reads that went through the page cache (direct_io = false)
    # RAM tier: keys answered without a read of their own (resident, or joining a read into the tier
    # already in flight), keys read from the pack, blocks evicted from the tier to admit another.
    ram_hits: int = 0
    ram_misses: int = 0
    ram_evictions: int = 0
    ram_checks: int = 0  # the scrub's checks of a resident block's crc32 (scheduler.py)
    ram_checked_bytes: int = 0
    protocol_errors: int = 0  # ERROR replies
    clients_total: int = 0
    clients_dropped: int = 0  # vanished (disconnect or heartbeat timeout) holding leases
    floods_cut: int = 0  # connections cut for sending faster than the main loop reads (flood.py)
    clients_silent: int = 0  # of those, dropped for sending nothing for heartbeat_timeout_s (protocol v4)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ClientCounters:
    """One session's share of the work, so that an operator running several workers against one
    expertd sees which of them asks, reads and waits: the daemon-wide Counters sum over every
    client, these do not. Kept for the life of the session (a reconnect starts a new one)."""

    fetches: int = 0  # FETCH messages accepted
    keys: int = 0  # keys asked for
    ready: int = 0  # READY sent
    failed: int = 0  # FAIL sent (errors, cancels, shutdown)
    served_bytes: int = 0  # payload bytes the READYs named (RAM tier or staging): what the client copied
    read_bytes: int = 0  # pack bytes read for keys this client asked first (a read others joined counts here)
    ram_hits: int = 0  # keys answered from the RAM tier without a read of their own (resident or joined)
    ram_misses: int = 0  # keys read from the pack for this client
    demand_latency: Histogram = field(default_factory=Histogram)  # FETCH to READY of demand keys: the stall

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items() if k != "demand_latency"}
        out["demand_latency_us"] = self.demand_latency.to_dict()  # buckets too: percentiles of any interval
        return out
