"""Which expert occupies which cache slot, and which one leaves when room is needed: LFU over the
whole run (how often each expert was selected), LRU among equals, never an expert of the current
step. Pure bookkeeping: no tensors, no devices, no daemon."""

from __future__ import annotations

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
    n_slots: int
    holder: list[ExpertKey | None] = field(init=False)  # slot -> the expert in it
    slot_of: dict[ExpertKey, int] = field(default_factory=dict)
    uses: dict[ExpertKey, int] = field(default_factory=dict)  # selections since start, resident or not
    last_use: dict[ExpertKey, int] = field(default_factory=dict)
    clock: int = 0

    def __post_init__(self) -> None:
        self.holder = [None] * self.n_slots

    def touch(self, keys: list[ExpertKey]) -> None:
        """A step selected these experts (hits and misses alike)."""
        self.clock += 1
        for k in keys:
            self.uses[k] = self.uses.get(k, 0) + 1
            self.last_use[k] = self.clock

    def victims(self, n: int, protected: set[ExpertKey]) -> list[int]:
        """n slots to fill: empty ones first, then the least used resident experts, the least
        recently used first among equals; never one in `protected` (this step's)."""
        empty = [s for s, k in enumerate(self.holder) if k is None]
        if len(empty) >= n:
            return empty[:n]
        candidates = sorted((k for k in self.slot_of if k not in protected),
                            key=lambda k: (self.uses.get(k, 0), self.last_use.get(k, 0), k))
        needed = n - len(empty)
        if len(candidates) < needed:
            raise CacheTooSmall(f"{n} experts to load but only {len(empty) + len(candidates)} slots may be reused")
        return empty + [self.slot_of[k] for k in candidates[:needed]]

    def place(self, slot: int, key: ExpertKey) -> ExpertKey | None:
        """Puts `key` in `slot`; returns the expert evicted from it, if any."""
        old = self.holder[slot]
        if old is not None:
            del self.slot_of[old]
        self.holder[slot] = key
        self.slot_of[key] = slot
        return old
