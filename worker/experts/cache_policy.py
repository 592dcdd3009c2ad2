"""Which expert occupies which cache slot, and which one leaves when room is needed. Two rules
rank the resident experts, and the one that would have hit more lately decides:
  frequency  the expert selected least often lately (a use counts 2**(-age / half-life): frequency
             that fades, LRFU), the least recently selected among equals. The half-life is
             HALF_LIFE_FILLS times the selections that would fill the cache once: long enough to
             keep the popular experts through a burst of rare ones, short enough to follow a new
             request's experts (plain LFU over a whole run never lets go of an old favourite).
  recency    the expert selected least recently (LRU).
Where tokens route independently, frequency is best (it keeps the popular experts); where routings
repeat in a cycle longer than the cache (a generation that loops, a batch replayed), recency is,
and frequency keeps an earlier phase's experts (BENCHMARKS.md: LRU at 0.96 of Belady on such a
trace where frequency reached 0.44). So each rule also runs on a shadow cache of the same size
(keys only, no bytes) fed the same selections; their hits, fading with a half-life of LEAD_FILLS
fills, say which rule ranks the real cache's victims (frequency on a tie). The shadows of a cache
of more than SHADOW_SLOTS slots see the steps of every stride-th layer only (stride = slots /
SHADOW_SLOTS, rounded up; layers counted in the order they are first seen) and hold slots / stride
experts: a sample of the layers stands for all of them, and the shadows cost a stride-th of a
whole second cache (the policy's time is on the decode step's path, a host sync per layer). An
expert of the current step is never evicted. Measured with `expertpack bench cache`
(BENCHMARKS.md). Pure bookkeeping: no tensors, no devices, no daemon."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from expertpack.packtools.layout import ExpertKey

HALF_LIFE_FILLS = 32  # half-life of a use, in selections, over the cache's slot count
LEAD_FILLS = 4  # half-life of a shadow's hits, in selections, over the slot count
SHADOW_SLOTS = 512  # a larger cache's shadows see every stride-th layer, at about this many slots


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
class FrequencyPolicy:
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
        self.renew(keys)

    def renew(self, keys: list[ExpertKey]) -> None:
        """The heap entries of `keys` that are resident, after their scores changed (touch(); or a
        shadow whose scores are another policy's, updated there)."""
        for k in keys:
            if k in self.slot_of:
                heapq.heappush(self._heap, self._entry(k))
        if len(self._heap) > 2 * len(self.slot_of) + 64:  # sweep the stale entries out
            self._heap = [self._entry(k) for k in self.slot_of]
            heapq.heapify(self._heap)

    @property
    def empty_slots(self) -> list[int]:
        """The slots no expert holds, ascending."""
        return self._empty

    def victims(self, n: int, protected: set[ExpertKey]) -> list[int]:
        """n slots to fill: empty ones first, then the resident experts of the lowest score, the
        least recently used first among equals; never one in `protected` (this step's)."""
        if len(self._empty) >= n:
            return self._empty[:n]
        needed = n - len(self._empty)
        chosen, met = self._lowest(needed, protected)
        if len(chosen) < needed and met < len(self.slot_of):  # residents without a current entry: renew all
            self._heap = [self._entry(k) for k in self.slot_of]
            heapq.heapify(self._heap)
            chosen, met = self._lowest(needed, protected)
        if len(chosen) < needed:
            raise CacheTooSmall(f"{n} experts to load but only {len(self._empty) + len(chosen)} slots may be reused")
        return self._empty + [self.slot_of[k] for k in chosen]

    def _lowest(self, needed: int, protected: set[ExpertKey]) -> tuple[list[ExpertKey], int]:
        """Up to `needed` resident experts off the heap, lowest first, not in `protected`; and how
        many resident experts were met (a heap entry is current only if renewed at each touch)."""
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
        return [k for _, _, k in chosen], len(seen)

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


class LruKeys:
    """LRU over keys only: the hits an LRU cache of n_slots would have had (the policy's recency
    shadow, and the LRU column of `expertpack bench cache`)."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.resident: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first

    def access(self, keys: list[ExpertKey]) -> int:
        hits = 0
        for k in sorted(keys):  # a step's keys are equally recent: ordered the same however they came
            if k in self.resident:
                hits += 1
                self.resident.move_to_end(k)
            else:
                self.resident[k] = None
        while len(self.resident) > self.n_slots:  # the least recent are never this step's (at most n_slots keys)
            self.resident.popitem(last=False)
        return hits


class _FrequencyShadow(FrequencyPolicy):
    """The frequency rule on a cache of its own, its scores the real policy's (the same selections
    give the same scores, so they are counted once): the hits it would have had."""

    def __init__(self, real: FrequencyPolicy, n_slots: int) -> None:
        super().__init__(n_slots, real.half_life)
        self.score, self.last_use = real.score, real.last_use

    def access(self, keys: list[ExpertKey]) -> int:
        self.renew(keys)
        misses = [k for k in keys if k not in self.slot_of]
        if misses:
            for slot, key in zip(self.victims(len(misses), set(keys)), misses):
                self.place(slot, key)
        return len(keys) - len(misses)


class CachePolicy:
    """The frequency rule or the recency rule, whichever's shadow cache has hit more lately (see
    the module's docstring). The resident experts are held by the frequency rule's bookkeeping
    (slots, scores, heap) and also kept in recency order; victims come from the leading rule."""

    def __init__(self, n_slots: int, half_life: float = 0.0, lead_fills: float = LEAD_FILLS) -> None:
        self.n_slots = n_slots
        self.frequency = FrequencyPolicy(n_slots, half_life)
        self.recency: OrderedDict[ExpertKey, None] = OrderedDict()  # resident, least recently selected first
        self._stride = -(-n_slots // SHADOW_SLOTS)  # the shadows see every stride-th layer first seen
        self._layer_index: dict[int, int] = {}  # layer -> the order it was first seen in
        shadow_slots = n_slots // self._stride
        self._shadows = (_FrequencyShadow(self.frequency, shadow_slots), LruKeys(shadow_slots))
        self.lead = [0.0, 0.0]  # fading hits of the frequency and the recency shadow
        self._lead_half_life = lead_fills * shadow_slots

    @property
    def slot_of(self) -> dict[ExpertKey, int]:
        return self.frequency.slot_of

    @property
    def holder(self) -> list[ExpertKey | None]:
        return self.frequency.holder

    @property
    def half_life(self) -> float:
        return self.frequency.half_life

    @property
    def rule(self) -> str:
        """The rule that picks victims now."""
        return "recency" if self.lead[1] > self.lead[0] else "frequency"

    def touch(self, keys: list[ExpertKey]) -> None:
        """A step selected these experts (hits and misses alike); at most n_slots of them."""
        self.frequency.touch(keys)
        for k in keys:
            if k in self.recency:
                self.recency.move_to_end(k)
        if not keys or self._layer_index.setdefault(keys[0].layer, len(self._layer_index)) % self._stride:
            return  # a step is one layer's, and this layer is not sampled
        if len(keys) > self._shadows[1].n_slots:  # a prefill's wave larger than the shadows: not replayed,
            self._shadows[0].renew(keys)  # but its scores, shared with the frequency shadow, moved
            return
        fade = 2 ** (-len(keys) / self._lead_half_life)
        self.lead = [lead * fade + shadow.access(keys) for lead, shadow in zip(self.lead, self._shadows)]

    def victims(self, n: int, protected: set[ExpertKey]) -> list[int]:
        """n slots to fill: empty ones first, then the leading rule's choice; never one in
        `protected` (this step's)."""
        empty = self.frequency.empty_slots
        if self.rule == "frequency" or len(empty) >= n:
            return self.frequency.victims(n, protected)
        needed = n - len(empty)
        last_use = self.frequency.last_use
        # self.recency is in the order of last use; the experts of one step come in whatever order
        # its caller listed them, so those tied with the last one taken are ordered by key.
        candidates: list[ExpertKey] = []
        for k in self.recency:
            if len(candidates) >= needed and last_use[k] != last_use[candidates[-1]]:
                break
            if k not in protected:
                candidates.append(k)
        if len(candidates) < needed:
            raise CacheTooSmall(f"{n} experts to load but only {len(empty) + len(candidates)} slots may be reused")
        candidates.sort(key=lambda k: (last_use[k], k))
        return empty[:] + [self.slot_of[k] for k in candidates[:needed]]

    def place(self, slot: int, key: ExpertKey) -> ExpertKey | None:
        """Puts `key` in `slot`; returns the expert evicted from it, if any."""
        old = self.frequency.place(slot, key)
        if old is not None:
            del self.recency[old]
        self.recency[key] = None
        return old

