"""Which expert occupies which cache slot, and which one leaves when room is needed: the expert
selected least often lately (a use counts 2**(-age / half-life): frequency that fades, LRFU),
the least recently selected among equals, never an expert of the current step. The half-life is
HALF_LIFE_FILLS times the selections that would fill the cache once: long enough to keep the
popular experts through a burst of rare ones, short enough to follow a new request's experts
(plain LFU over a whole run never lets go of an old request's favourites). Measured with
`expertpack bench cache` (BENCHMARKS.md). Pure bookkeeping: no tensors, no devices, no daemon."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from expertpack.packtools.layout import ExpertKey

HALF_LIFE_FILLS = 32  # half-life of a use, in selections, over the cache's slot count


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
    """Fading frequency, LRU among equals, this step's experts protected. An expert's score is
    log2 of the sum over its selections of 2**(t / half_life), t counting selections (every key of
    every step): comparing scores compares the faded counts without ever rescaling them. Victims
    come from a heap of (score, last use, key) entries of resident experts, renewed as they are
    touched (stale ones are skipped when met): O(log n) per eviction, where sorting every resident
    expert at each miss cost O(n log n) per layer call (milliseconds per token with tens of
    thousands of slots)."""

    n_slots: int
    half_life: float = 0.0  # in selections; 0: HALF_LIFE_FILLS x n_slots
    holder: list[ExpertKey | None] = field(init=False)  # slot -> the expert in it
    slot_of: dict[ExpertKey, int] = field(default_factory=dict)
    score: dict[ExpertKey, float] = field(default_factory=dict)  # every expert selected, resident or not
    last_use: dict[ExpertKey, int] = field(default_factory=dict)
    clock: int = 0  # steps
    selections: int = 0
    _empty: list[int] = field(init=False, repr=False)  # empty slots, ascending
    _heap: list[tuple[float, int, ExpertKey]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.holder = [None] * self.n_slots
        self.half_life = self.half_life or HALF_LIFE_FILLS * self.n_slots
        self._empty = list(range(self.n_slots))
        self._heap = []

    def touch(self, keys: list[ExpertKey]) -> None:
        """A step selected these experts (hits and misses alike)."""
        self.clock += 1
        self.selections += len(keys)
        now = self.selections / self.half_life
        for k in keys:
            old = self.score.get(k)
            # log2(2**old + 2**now), the larger term factored out so that nothing overflows
            self.score[k] = now if old is None else max(old, now) + math.log2(1 + 2 ** -abs(old - now))
            self.last_use[k] = self.clock
            if k in self.slot_of:
                heapq.heappush(self._heap, self._entry(k))
        if len(self._heap) > 2 * len(self.slot_of) + 64:  # sweep the stale entries out
            self._heap = [self._entry(k) for k in self.slot_of]
            heapq.heapify(self._heap)

    def victims(self, n: int, protected: set[ExpertKey]) -> list[int]:
        """n slots to fill: empty ones first, then the resident experts of the lowest score, the
        least recently used first among equals; never one in `protected` (this step's)."""
        if len(self._empty) >= n:
            return self._empty[:n]
        needed = n - len(self._empty)
        chosen: list[tuple[float, int, ExpertKey]] = []
        kept: list[tuple[float, int, ExpertKey]] = []
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

    def _entry(self, k: ExpertKey) -> tuple[float, int, ExpertKey]:
        return self.score.get(k, -math.inf), self.last_use.get(k, 0), k
