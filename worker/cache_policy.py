"""Which expert occupies which cache slot, and which one leaves when room is needed: LFU over the
whole run (how often each expert was selected), LRU among equals, never an expert of the current
step. Pure bookkeeping: no tensors, no devices, no daemon."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from expertpack.packtools.layout import ExpertKey


class CacheTooSmall(ValueError):
    """The cache cannot hold every expert one step of one layer may select."""


def slot_count(cache_bytes: int, free_bytes: int, reserve_bytes: int, payload_bytes: int, needed: int) -> int:
    """floor(min(requested, free - reserve) / payload); refuses a cache below `needed` slots."""
    budget = min(cache_bytes, free_bytes - reserve_bytes)
    slots = max(0, budget) // payload_bytes
    if slots < needed:
        raise CacheTooSmall(
            f"an expert cache of {max(0, budget) / 2**20:.0f} MiB holds {slots} experts of {payload_bytes:,} bytes, "
            f"but one layer can select {needed}; give it at least {math.ceil(needed * payload_bytes / 2**20)} MiB "
            f"(--cache-vram-mib), or lower --cache-reserve-mib if the device has the room")
    return slots


@dataclass
class CachePolicy:
    """LFU over the run, LRU among equals, this step's experts protected. Victims come from a heap of
    (uses, last use, key) entries of resident experts, renewed as they are touched (stale ones are
    skipped when met): O(log n) per eviction, where sorting every resident expert at each miss cost
    O(n log n) per layer call (milliseconds per token with tens of thousands of slots)."""

    n_slots: int
    holder: list[ExpertKey | None] = field(init=False)  # slot -> the expert in it
    slot_of: dict[ExpertKey, int] = field(default_factory=dict)
    uses: dict[ExpertKey, int] = field(default_factory=dict)  # selections since start, resident or not
    last_use: dict[ExpertKey, int] = field(default_factory=dict)
    clock: int = 0
    _empty: list[int] = field(init=False, repr=False)  # empty slots, ascending
    _heap: list[tuple[int, int, ExpertKey]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.holder = [None] * self.n_slots
        self._empty = list(range(self.n_slots))
        self._heap = []

    def touch(self, keys: list[ExpertKey]) -> None:
        """A step selected these experts (hits and misses alike)."""
        self.clock += 1
        for k in keys:
            self.uses[k] = self.uses.get(k, 0) + 1
            self.last_use[k] = self.clock
            if k in self.slot_of:
                heapq.heappush(self._heap, self._entry(k))
        if len(self._heap) > 2 * len(self.slot_of) + 64:  # sweep the stale entries out
            self._heap = [self._entry(k) for k in self.slot_of]
            heapq.heapify(self._heap)

    def victims(self, n: int, protected: set[ExpertKey]) -> list[int]:
        """n slots to fill: empty ones first, then the least used resident experts, the least
        recently used first among equals; never one in `protected` (this step's)."""
        if len(self._empty) >= n:
            return self._empty[:n]
        needed = n - len(self._empty)
        chosen: list[tuple[int, int, ExpertKey]] = []
        kept: list[tuple[int, int, ExpertKey]] = []
        seen: set[ExpertKey] = set()
        while len(chosen) < needed and self._heap:
            entry = heapq.heappop(self._heap)
            k = entry[2]
            if k not in self.slot_of or entry != self._entry(k) or k in seen:
                continue  # stale (evicted since, or touched again: a newer entry exists), or a twin
            seen.add(k)
            (kept if k in protected else chosen).append(entry)
        for entry in chosen + kept:  # still resident until place() replaces them
            heapq.heappush(self._heap, entry)
        if len(chosen) < needed:
            raise CacheTooSmall(f"{n} experts to load but only {len(self._empty) + len(chosen)} slots may be reused")
        return self._empty + [self.slot_of[k] for _, _, k in chosen]

    def place(self, slot: int, key: ExpertKey) -> ExpertKey | None:
        """Puts `key` in `slot`; returns the expert evicted from it, if any."""
        old = self.holder[slot]
        if old is not None:
            del self.slot_of[old]
        else:
            self._empty.remove(slot)
        self.holder[slot] = key
        self.slot_of[key] = slot
        heapq.heappush(self._heap, self._entry(key))
        return old

    def _entry(self, k: ExpertKey) -> tuple[int, int, ExpertKey]:
        return self.uses.get(k, 0), self.last_use.get(k, 0), k
