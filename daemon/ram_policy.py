"""Which blocks the RAM tier keeps: the ones asked for most often lately. A request counts
2**(-age / half-life) (frequency that fades, LRFU, the rule of the worker's VRAM cache in
worker/experts/cache_policy.py, written again here because the daemon never imports the worker); the least
recently asked for goes first among equals. Unlike the VRAM cache, which must place every miss, the
RAM tier admits a block only over a victim asked for no more often than it, so that a scan of cold
keys (a prompt touching every expert once) cannot flush the hot set. Pure bookkeeping over keys:
no slots, no bytes."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from expertpack.packtools.layout import ExpertKey

HALF_LIFE_FILLS = 32  # half-life of a request, in keys asked for, over the tier's slot count (as the worker's)


@dataclass
class RamPolicy:
    """Scores are log2 of the faded request counts (comparing them compares the counts, and they
    never need rescaling); victims come from a heap of (score, last request, key) entries of the
    admitted keys, renewed as keys are asked for, stale entries skipped when met (O(log n) per
    eviction)."""

    n_slots: int
    half_life: float = 0.0  # in keys asked for; 0: HALF_LIFE_FILLS x n_slots
    score: dict[ExpertKey, float] = field(default_factory=dict)  # every key asked for, admitted or not
    last_use: dict[ExpertKey, int] = field(default_factory=dict)
    admitted: set[ExpertKey] = field(default_factory=set)
    clock: int = 0  # touch() calls
    requests: int = 0  # keys asked for
    _heap: list[tuple[float, int, ExpertKey]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.half_life = self.half_life or HALF_LIFE_FILLS * max(1, self.n_slots)

    def touch(self, keys: tuple[ExpertKey, ...] | list[ExpertKey]) -> None:
        """One request asked for these keys."""
        self.clock += 1
        self.requests += len(keys)
        now = self.requests / self.half_life
        for k in keys:
            old = self.score.get(k)
            # log2(2**old + 2**now), the larger term factored out so that nothing overflows
            self.score[k] = now if old is None else max(old, now) + math.log2(1 + 2 ** -abs(old - now))
            self.last_use[k] = self.clock
            if k in self.admitted:
                heapq.heappush(self._heap, self._entry(k))
        if len(self._heap) > 2 * len(self.admitted) + 64:  # sweep the stale entries out
            self._heap = [self._entry(k) for k in self.admitted]
            heapq.heapify(self._heap)

    def victim(self, newcomer: ExpertKey, evictable: Callable[[ExpertKey], bool]) -> ExpertKey | None:
        """The admitted key to make room for `newcomer`: the lowest score, least recently asked for
        among equals, among those `evictable` says may go; None when there is none, or when it is
        asked for more than the newcomer (then the newcomer is not admitted)."""
        kept: list[tuple[float, int, ExpertKey]] = []
        found: tuple[float, int, ExpertKey] | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            k = entry[2]
            if k not in self.admitted or entry != self._entry(k):
                continue  # stale: gone since, or asked for again (a newer entry exists)
            kept.append(entry)
            if evictable(k):
                found = entry
                break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        if found is None or found[:2] > self._entry(newcomer)[:2]:
            return None
        return found[2]

    def admit(self, key: ExpertKey) -> None:
        self.admitted.add(key)
        heapq.heappush(self._heap, self._entry(key))

    def forget(self, key: ExpertKey) -> None:
        """`key` left the tier (evicted, or its read failed); its score stays for its next request."""
        self.admitted.discard(key)

    def _entry(self, k: ExpertKey) -> tuple[float, int, ExpertKey]:
        return self.score.get(k, -math.inf), self.last_use.get(k, 0), k
