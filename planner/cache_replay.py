"""The expert cache replayed on a routing trace, without a device: each MoE layer call asks at once for
the unique experts its tokens selected (in waves of at most the cache's size), all resident together,
a miss always loaded, and hits counted as the expert cache counts them. The worker's own policy
(cache_policy.py) runs beside its frequency rule alone, LRU, LFU, LFU told the whole trace's counts,
and Belady's optimum.
`expertpack bench cache` prints these rows; `expertpack plan` predicts hit rates from them, with
expertd's RAM tier behind the VRAM cache (tiered_hit_rates). Pure bookkeeping: no torch, no
running daemon."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from expertpack.packtools.layout import ALIGNMENT, ExpertKey, Manifest
from expertpack.packtools.units import GIB

from expertpack.worker.experts.cache_policy import CachePolicy, FrequencyPolicy, LruKeys
from expertpack.worker.experts.routing_trace import Trace, unique_experts

Requests = Sequence[Sequence[ExpertKey]]  # per layer call, the unique keys it needs at once


def requests_of(trace: Trace) -> list[list[ExpertKey]]:
    return [[ExpertKey(layer, e) for e in experts] for layer, experts in unique_experts(trace.calls)]


def waves(requests: Requests, n_slots: int) -> list[list[ExpertKey]]:
    """A call needing more experts than the cache holds is loaded in waves of n_slots, as
    ExpertCache.expert_rows does; each wave is one request."""
    out = []
    for keys in requests:
        for start in range(0, len(keys), n_slots):
            out.append(list(keys[start:start + n_slots]))
    return out


# ---- online policies: access(keys) -> hits, the keys made resident together ---------------------
LRU = LruKeys  # a step's keys enter as equally recent, ordered by key


class LFU:
    """Counts live only while resident (classic LFU); ties go to the least recently used."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.count: dict[ExpertKey, int] = {}
        self.last: dict[ExpertKey, int] = {}
        self.heap: list[tuple[int, int, ExpertKey]] = []  # (count, last use, key); stale entries skipped
        self.clock = 0

    def access(self, keys: Sequence[ExpertKey]) -> int:
        self.clock += 1
        hits = sum(k in self.count for k in keys)
        need = len(self.count) + len(keys) - hits - self.n_slots
        wanted = set(keys)
        while need > 0:
            c, t, k = heapq.heappop(self.heap)
            if self.count.get(k) != c or self.last[k] != t or k in wanted:
                continue  # stale, or this request's (whose entry is renewed below)
            del self.count[k], self.last[k]
            need -= 1
        for k in keys:
            self.count[k] = self._count(k)
            self.last[k] = self.clock
            heapq.heappush(self.heap, (self.count[k], self.clock, k))
        if len(self.heap) > 4 * len(self.count) + 64:  # drop stale entries now and then
            self.heap = [(self.count[k], self.last[k], k) for k in self.count]
            heapq.heapify(self.heap)
        return hits

    def _count(self, k: ExpertKey) -> int:
        return self.count.get(k, 0) + 1


class KnownCounts(LFU):
    """LFU told every expert's count over the whole trace up front (so not an online policy): it
    keeps the most popular experts. Where selections are independent draws from fixed popularities
    (as in a synthetic model, whose tokens are independent), keeping the most popular is the best
    any online policy can do, so this column bounds what a better online policy could gain."""

    def __init__(self, n_slots: int, totals: dict[ExpertKey, int]) -> None:
        super().__init__(n_slots)
        self.totals = totals

    def _count(self, k: ExpertKey) -> int:
        return self.totals[k]


def known_counts_hits(requests: Requests, n_slots: int) -> int:
    totals: dict[ExpertKey, int] = {}
    for keys in requests:
        for k in keys:
            totals[k] = totals.get(k, 0) + 1
    return online_hits(lambda n: KnownCounts(n, totals), requests, n_slots)


class InUse:
    """worker/cache_policy.CachePolicy driven exactly as ExpertCache._acquire drives it: touch every
    key of the request, then victims for the misses (this request's keys protected), then place."""

    def __init__(self, n_slots: int, policy: Callable[[int], CachePolicy] = CachePolicy) -> None:
        self.policy = policy(n_slots)

    def access(self, keys: Sequence[ExpertKey]) -> int:
        keys = list(keys)
        self.policy.touch(keys)
        misses = [k for k in keys if k not in self.policy.slot_of]
        if misses:
            for slot, key in zip(self.policy.victims(len(misses), set(keys)), misses):
                self.policy.place(slot, key)
        return len(keys) - len(misses)


def online_hits(make: Callable[[int], object], requests: Requests, n_slots: int) -> int:
    cache = make(n_slots)
    return sum(cache.access(keys) for keys in waves(requests, n_slots))


# ---- the offline optimum --------------------------------------------------------------------------
def belady_hits(requests: Requests, n_slots: int) -> int:
    """Belady's MIN for requests of several keys that must be resident together: on a miss with
    the cache full, evict the resident key (not of this request) whose next request lies
    furthest ahead, never-again first. O(total keys x log) with precomputed next uses."""
    reqs = waves(requests, n_slots)
    never = len(reqs)  # beyond every request
    next_use: list[list[int]] = [[]] * len(reqs)
    upcoming: dict[ExpertKey, int] = {}
    for t in range(len(reqs) - 1, -1, -1):
        next_use[t] = [upcoming.get(k, never) for k in reqs[t]]
        for k in reqs[t]:
            upcoming[k] = t
    resident: dict[ExpertKey, int] = {}  # key -> its next request
    heap: list[tuple[int, ExpertKey]] = []  # (-next request, key); entries whose next moved on are stale
    hits = 0
    for t, keys in enumerate(reqs):
        # This request's resident keys have next request t, every other resident one later: the
        # max-heap reaches them last, and there are always enough others (n_slots >= len(keys)).
        n_hit = sum(k in resident for k in keys)
        hits += n_hit
        for _ in range(len(resident) + len(keys) - n_hit - n_slots):
            while True:
                neg, k = heapq.heappop(heap)
                if resident.get(k) == -neg:
                    break
            assert -neg > t, "Belady would evict a key of the current request"
            del resident[k]
        for k, nxt in zip(keys, next_use[t]):
            resident[k] = nxt
            heapq.heappush(heap, (-nxt, k))
    return hits


POLICIES: dict[str, Callable[[Requests, int], int]] = {
    "lru": lambda r, n: online_hits(LRU, r, n),
    "lfu": lambda r, n: online_hits(LFU, r, n),
    "frequency": lambda r, n: online_hits(lambda m: InUse(m, FrequencyPolicy), r, n),
    "in_use": lambda r, n: online_hits(InUse, r, n),
    "known_counts": known_counts_hits,
    "belady": belady_hits,
}


@dataclass
class Row:
    slots: int
    share: float  # of all the model's experts
    gib: float | None  # with a pack's slot size
    requests: int  # unique keys asked for, over all waves
    hit_rate: dict[str, float]

    @property
    def in_use_of_belady(self) -> float:
        best = self.hit_rate["belady"]
        return self.hit_rate["in_use"] / best if best else 1.0


def replay(trace: Trace, sizes: Sequence[int], slot_bytes: int | None = None,
           policies: Sequence[str] = tuple(POLICIES)) -> list[Row]:
    requests = requests_of(trace)
    rows = []
    for n in sizes:
        n_requests = sum(len(w) for w in waves(requests, n))
        rates = {p: POLICIES[p](requests, n) / n_requests if n_requests else 0.0 for p in policies}
        rows.append(Row(n, n / trace.header.n_keys, n * slot_bytes / GIB if slot_bytes else None, n_requests, rates))
    return rows


def pack_slot_bytes(manifest: Manifest) -> int:
    """One cache slot: the largest expert block rounded up to the alignment, as the worker's
    ExpertCache sizes them (worker/expert_cache.slot_bytes, which needs torch)."""
    return -(-max(l.payload_bytes for l in manifest.layers) // ALIGNMENT) * ALIGNMENT



def tiered_hit_rates(requests: Requests, vram_slots: int, ram_slots: int, warmup: int = 0) -> tuple[float, float]:
    """The worker's VRAM cache (its own policy) over the requests, and expertd's RAM tier (its own
    policy and admission rule, daemon/ram_policy.py) over what the VRAM cache missed, each layer
    call's misses one FETCH: (VRAM hits / keys requested, RAM hits / VRAM misses), counted after
    the first `warmup` waves. A block admitted for this FETCH is still being read, so it is not
    evicted for another of its keys (as in the daemon); holds on RAM blocks being copied are not
    modelled (with one worker a block is held only while its layer's misses are copied, never when
    the next FETCH comes), nor are the worker's prefetches, which the daemon counts as requests too."""
    from expertpack.daemon.ram_policy import RamPolicy  # pure bookkeeping; the daemon's own rule

    vram = InUse(vram_slots)
    ram = RamPolicy(ram_slots)
    requested = vram_hits = misses = ram_hits = 0
    for t, keys in enumerate(waves(requests, vram_slots)):
        counted = t >= warmup
        missed = [k for k in keys if k not in vram.policy.slot_of]
        hits = vram.access(keys)
        if counted:
            requested, vram_hits, misses = requested + len(keys), vram_hits + hits, misses + len(missed)
        if not missed or not ram_slots:
            continue
        ram.touch(missed)
        reading: set[ExpertKey] = set()  # admitted for this FETCH: not evicted before it is read
        for k in missed:
            if k in ram.admitted:
                ram_hits += counted
            elif len(ram.admitted) < ram_slots:
                ram.admit(k)
                reading.add(k)
            else:
                victim = ram.victim(k, lambda v: v not in reading)
                if victim is not None:
                    ram.forget(victim)
                    ram.admit(k)
                    reading.add(k)
    return (vram_hits / requested if requested else 0.0, ram_hits / misses if misses else 0.0)


def uniform_requests(n_layers: int, n_expert: int, k: int, n_tokens: int, seed: int = 0) -> list[list[ExpertKey]]:
    """Routing that spreads tokens uniformly and independently: each token, each layer, k distinct
    experts drawn at random (a synthetic model's router, `expertpack synth` without a skew)."""
    rng = random.Random(seed)
    return [[ExpertKey(layer, e) for e in sorted(rng.sample(range(n_expert), k))]
            for _ in range(n_tokens) for layer in range(n_layers)]
