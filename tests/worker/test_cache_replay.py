"""The cache replay's policies: hit counts on traces worked out by hand (Belady beats LRU on a loop
one key larger than the cache; LFU keeps a hot key LRU drops), and Belady equal to an exhaustive
search for the best eviction sequence on small random traces and never beaten by an online policy."""

from __future__ import annotations

import functools
import random

import pytest

from expertpack.packtools.layout import ExpertKey
from expertpack.planner.cache_replay import LFU, LRU, InUse, belady_hits, known_counts_hits, online_hits
from expertpack.worker.experts.cache_policy import FrequencyPolicy

A, B, C, D = (ExpertKey(0, i) for i in range(4))
ONLINE = {"lru": LRU, "lfu": LFU, "frequency": lambda n: InUse(n, FrequencyPolicy), "in_use": InUse}


def singles(*keys: ExpertKey) -> list[list[ExpertKey]]:
    return [[k] for k in keys]


def hits(requests, n_slots: int) -> dict[str, int]:
    out = {name: online_hits(make, requests, n_slots) for name, make in ONLINE.items()}
    out["known_counts"] = known_counts_hits(requests, n_slots)
    out["belady"] = belady_hits(requests, n_slots)
    return out


def test_a_loop_one_larger_than_the_cache() -> None:
    """A B C D three times, 3 slots: LRU (and the LFUs, ties going to LRU) always evict the key
    needed next: 0 hits. Belady hits A B (2nd round), D A (3rd after evicting B), C D: 6 of 12."""
    trace = singles(A, B, C, D) * 3
    assert hits(trace, 3) == {"lru": 0, "lfu": 0, "frequency": 0, "in_use": 0, "known_counts": 0, "belady": 6}


def test_lfu_keeps_the_hot_key_that_lru_drops() -> None:
    """A A B C A, 2 slots: C evicts A under LRU (A is older than B), B under LFU (A was used twice)."""
    trace = singles(A, A, B, C, A)
    assert hits(trace, 2) == {"lru": 1, "lfu": 2, "frequency": 2, "in_use": 2, "known_counts": 2, "belady": 2}


def test_the_policy_in_use_remembers_counts_across_evictions() -> None:
    """A A A then B C four times over, 2 slots. LRU evicts A at the first C and hits every B and C
    after: 2 + 6. In-cache LFU keeps A (count 3) and thrashes B and C in the other slot, each coming
    back with a count of 1: 2. The policy's frequency rule counts uses over the run: B and C come
    back with their history, reach A's 3 at the 9th request and A (older) leaves: 2 + 2. Its recency
    shadow has hit B and C by the 6th request, once more than the frequency shadow, and from the
    7th the recency rule evicts A: 2 + 5. Knowing the counts (A 3, B and C 4 each), A leaves at the
    first C: 2 + 6, as under Belady."""
    trace = singles(A, A, A, B, C, B, C, B, C, B, C)
    assert hits(trace, 2) == {"lru": 8, "lfu": 2, "frequency": 4, "in_use": 7, "known_counts": 8, "belady": 8}


def test_a_request_is_resident_together() -> None:
    """Requests of two keys in a cache of 2: each request fills the cache; nothing of it may be
    evicted for its own other key. [A B] [C D] [A B]: 0 hits for all, Belady included. With 3
    slots one of A, B survives [C D] under every policy: 1 hit each."""
    trace = [[A, B], [C, D], [A, B]]
    assert hits(trace, 2) == {"lru": 0, "lfu": 0, "frequency": 0, "in_use": 0, "known_counts": 0, "belady": 0}
    assert hits(trace, 3) == {"lru": 1, "lfu": 1, "frequency": 1, "in_use": 1, "known_counts": 1, "belady": 1}


def best_hits(requests: list[list[ExpertKey]], n_slots: int) -> int:
    """The most hits any eviction sequence reaches: every choice of victims tried."""
    from itertools import combinations

    @functools.lru_cache(maxsize=None)
    def go(t: int, resident: frozenset) -> int:
        if t == len(requests):
            return 0
        keys = requests[t]
        n_hit = sum(k in resident for k in keys)
        need = len(resident) + len(keys) - n_hit - n_slots
        others = sorted(resident - set(keys))
        best = -1
        for out in combinations(others, max(0, need)):
            best = max(best, go(t + 1, (resident - set(out)) | set(keys)))
        return n_hit + best

    return go(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_is_the_optimum_on_random_traces(seed: int) -> None:
    rng = random.Random(seed)
    n_keys, n_slots = rng.randint(3, 6), rng.randint(2, 4)
    keys = [ExpertKey(rng.randint(0, 1), rng.randint(0, 3)) for _ in range(n_keys)]
    keys = sorted(set(keys))
    requests = [rng.sample(keys, rng.randint(1, min(n_slots, len(keys), 2))) for _ in range(rng.randint(4, 12))]
    optimum = best_hits(requests, n_slots)
    got = hits(requests, n_slots)
    assert got["belady"] == optimum, (requests, n_slots, got)
    assert all(got[p] <= optimum for p in got), got


def test_every_policy_hits_all_but_the_first_uses_when_everything_fits() -> None:
    rng = random.Random(7)
    keys = [ExpertKey(l, e) for l in range(3) for e in range(8)]
    requests = [rng.sample(keys, 4) for _ in range(200)]
    distinct = len({k for r in requests for k in r})
    want = sum(map(len, requests)) - distinct
    assert hits(requests, len(keys)) == {p: want for p in ("lru", "lfu", "frequency", "in_use", "known_counts", "belady")}
