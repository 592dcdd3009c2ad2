"""The expert cache's policy on its own: which slot a miss fills (empty ones first, then the least
frequently selected expert, uses fading with a half-life, the least recently selected among
equals, never one of the current step) and how many slots a byte budget buys, refusing a cache
that cannot hold one step."""

from __future__ import annotations

import math
import random

import pytest

from expertpack.packtools.layout import ExpertKey
from expertpack.worker.experts.cache_policy import SHADOW_SLOTS, CachePolicy, CacheTooSmall, FrequencyPolicy, LruKeys, slot_count

MIB = 2**20


def filled(*keys: ExpertKey, rule: type = FrequencyPolicy) -> FrequencyPolicy:
    policy = rule(len(keys))
    for slot, key in enumerate(keys):
        policy.place(slot, key)
    return policy


A, B, C, D, E = (ExpertKey(0, i) for i in range(5))


@pytest.mark.parametrize("rule", [FrequencyPolicy, CachePolicy])
def test_empty_slots_are_used_before_anything_is_evicted(rule: type) -> None:
    policy = rule(4)
    policy.touch([A])
    policy.place(2, A)
    assert policy.victims(3, protected={B}) == [0, 1, 3]


def test_the_least_frequently_used_expert_leaves_first() -> None:
    policy = filled(A, B, C)
    policy.touch([A, B])
    policy.touch([A, C])
    policy.touch([C])  # uses: A 2, B 1, C 2; B is also not the least recent
    assert policy.victims(1, protected=set()) == [policy.slot_of[B]]


def test_equal_use_counts_evict_the_least_recently_used() -> None:
    policy = filled(A, B, C)
    policy.touch([B])
    policy.touch([C])
    policy.touch([A])  # one use each; B is the oldest
    assert policy.victims(1, protected=set()) == [policy.slot_of[B]]
    assert policy.victims(2, protected=set()) == [policy.slot_of[B], policy.slot_of[C]]


def test_frequency_counts_survive_eviction() -> None:
    """An expert evicted and brought back keeps its history."""
    policy = filled(A, B)
    for _ in range(3):
        policy.touch([A])
    policy.touch([B])
    policy.touch([C])
    assert policy.place(policy.victims(1, protected={C})[0], C) == B  # B (1 use) leaves, not A (3)
    policy.touch([B])  # B again: 2 uses now, more than C's 1
    assert policy.place(policy.victims(1, protected={B})[0], B) == C


def test_old_favourites_fade() -> None:
    """A used 40 times long ago loses to B used twice lately: each use counts half as much per
    half-life (32 cache fills of selections) of age. Within a half-life frequency still wins."""
    policy = filled(A, B)
    assert policy.half_life == 64
    for _ in range(40):
        policy.touch([A])
    for _ in range(400):  # 400 selections of others: A's 40 uses are worth 40 / 2**(400/64) < 1
        policy.touch([C])
    policy.touch([B])
    policy.touch([B])
    assert policy.victims(1, protected=set()) == [policy.slot_of[A]]
    fresh = filled(A, B)
    for _ in range(5):
        fresh.touch([A])
    fresh.touch([B])
    fresh.touch([B])  # two recent uses against five slightly older ones
    assert fresh.victims(1, protected=set()) == [fresh.slot_of[B]]


@pytest.mark.parametrize("rule", [FrequencyPolicy, CachePolicy])
def test_the_current_step_is_never_evicted(rule: type) -> None:
    policy = filled(A, B, C, rule=rule)
    policy.touch([A, B, C])
    policy.touch([A, B, C])
    policy.touch([D, E])  # D and E are rare and recent: still, A and B of the step stay
    policy.place(policy.victims(1, protected={A, B, D, E})[0], D)
    assert policy.holder.count(C) == 0 and {A, B, D} == set(policy.slot_of)
    with pytest.raises(CacheTooSmall, match="2 experts to load but only 1 slots may be reused"):
        policy.victims(2, protected={A, B, E})


@pytest.mark.parametrize("rule", [FrequencyPolicy, CachePolicy])
def test_place_reports_what_it_evicted(rule: type) -> None:
    policy = rule(1)
    assert policy.place(0, A) is None
    assert policy.place(0, B) == A
    assert policy.slot_of == {B: 0} and policy.holder == [B]


def test_slot_count_takes_the_smaller_of_the_budget_and_what_is_free() -> None:
    payload = 3 * MIB
    assert slot_count(100 * MIB, 1000 * MIB, 0, payload, needed=8) == 33
    assert slot_count(100 * MIB, 60 * MIB, 10 * MIB, payload, needed=8) == 16  # free - reserve wins
    assert slot_count(24 * MIB, 1000 * MIB, 0, payload, needed=8) == 8  # exactly one step


def test_slot_count_refuses_a_cache_below_one_step() -> None:
    with pytest.raises(CacheTooSmall, match=r"holds 7 experts .* can select 8; give it at least 24 MiB"):
        slot_count(23 * MIB, 1000 * MIB, 0, 3 * MIB, needed=8)
    with pytest.raises(CacheTooSmall, match=r"give it at least 1 MiB"):  # 0.42 MiB is not "at least 0 MiB"
        slot_count(0, 1000 * MIB, 0, 110_592, needed=4)
    with pytest.raises(CacheTooSmall, match="holds 0 experts"):
        slot_count(100 * MIB, 10 * MIB, 20 * MIB, 3 * MIB, needed=8)  # the reserve exceeds what is free


def naive_victims(policy: FrequencyPolicy, n: int, protected: set[ExpertKey]) -> list[int]:
    """The rule written out: every resident expert sorted by (score, last use, key)."""
    empty = [s for s, k in enumerate(policy.holder) if k is None]
    if len(empty) >= n:
        return empty[:n]
    candidates = sorted((k for k in policy.slot_of if k not in protected),
                        key=lambda k: (policy.score.get(k, -math.inf), policy.last_use.get(k, 0), k))
    return empty + [policy.slot_of[k] for k in candidates[:n - len(empty)]]


@pytest.mark.parametrize("seed", range(5))
def test_the_heap_picks_what_sorting_every_resident_expert_picks(seed: int) -> None:
    """Driven as the expert cache drives it over a long random run with hot and cold experts (and
    evicted experts coming back): every victims() answer equals the sorted rule's."""
    rng = random.Random(seed)
    keys = [ExpertKey(l, e) for l in range(4) for e in range(24)]
    weights = [1 / (i + 1) for i in range(len(keys))]
    policy = FrequencyPolicy(rng.randint(8, 40))
    for _ in range(3000):
        step = list(dict.fromkeys(rng.choices(keys, weights, k=rng.randint(1, 8))))
        policy.touch(step)
        misses = [k for k in step if k not in policy.slot_of]
        if misses:
            want = naive_victims(policy, len(misses), set(step))
            assert policy.victims(len(misses), set(step)) == want
            for slot, key in zip(want, misses):
                policy.place(slot, key)
    assert len(policy._heap) <= 2 * len(policy.slot_of) + 64 + 8  # stale entries are swept at each touch


def drive(policy: CachePolicy | FrequencyPolicy, steps: list[list[ExpertKey]]) -> int:
    """Runs the steps as the expert cache does (touch, victims for the misses, place); returns hits."""
    hits = 0
    for step in steps:
        policy.touch(step)
        misses = [k for k in step if k not in policy.slot_of]
        hits += len(step) - len(misses)
        if misses:
            for slot, key in zip(policy.victims(len(misses), set(step)), misses):
                policy.place(slot, key)
    return hits


def lru_hits(n_slots: int, steps: list[list[ExpertKey]]) -> int:
    resident: list[ExpertKey] = []  # least recent first
    hits = 0
    for step in steps:
        hits += sum(k in resident for k in step)
        resident = [k for k in resident if k not in step] + step
        resident = resident[-n_slots:]
    return hits


def test_a_new_working_set_takes_over_once_recency_leads() -> None:
    """After a long phase on one set of experts, a generation moves to another of the cache's size:
    the frequency rule keeps the old set (its faded counts still lead) and the new experts evict
    each other; the recency shadow hits at once, so the policy follows it and hits nearly as LRU."""
    old = [ExpertKey(0, i) for i in range(8)]
    new = [ExpertKey(1, i) for i in range(8)]
    warm = [old[i:i + 4] for i in (0, 4)] * 100
    phase = [[new[(i + j) % 8] for j in range(3)] for i in range(0, 8 * 40, 3)]  # rotating through the new set
    frequency, adaptive = FrequencyPolicy(8), CachePolicy(8)
    drive(frequency, warm)
    drive(adaptive, warm)
    assert adaptive.rule == "frequency"  # a tie so far: frequency
    lru = lru_hits(8, warm + phase) - lru_hits(8, warm)
    freq_hits, adaptive_hits = drive(frequency, phase), drive(adaptive, phase)
    assert adaptive.rule == "recency" and set(adaptive.slot_of) == set(new)
    assert adaptive_hits >= 0.95 * lru, (adaptive_hits, lru)
    assert freq_hits < 0.8 * lru, (freq_hits, lru)


def test_independent_popular_experts_stay_with_frequency() -> None:
    """Tokens drawing experts independently from fixed popularities: frequency keeps the popular
    ones and beats LRU; the policy stays with it."""
    rng = random.Random(3)
    keys = [ExpertKey(0, i) for i in range(64)]
    weights = [1 / (i + 1) ** 1.1 for i in range(64)]
    steps = [list(dict.fromkeys(rng.choices(keys, weights, k=4))) for _ in range(4000)]
    freq_hits, adaptive_hits = drive(FrequencyPolicy(16), steps), drive(CachePolicy(16), steps)
    assert adaptive_hits >= 0.98 * freq_hits
    assert adaptive_hits > 1.05 * lru_hits(16, steps), (adaptive_hits, lru_hits(16, steps))


class RecencyLeads(CachePolicy):
    @property
    def rule(self) -> str:
        return "recency"


@pytest.mark.parametrize("seed", range(5))
def test_under_the_recency_rule_the_cache_holds_what_lru_holds(seed: int) -> None:
    """Driven over a long random run with the recency rule leading: no victim is of the current
    step or named twice, and the resident experts are always the ones LRU keeps, whatever order
    a step lists its keys in."""
    rng = random.Random(seed)
    keys = [ExpertKey(l, e) for l in range(3) for e in range(20)]
    n = rng.randint(8, 30)
    policy, lru = RecencyLeads(n), LruKeys(n)
    for _ in range(2000):
        step = rng.sample(keys, rng.randint(1, 8))
        policy.touch(step)
        lru.access(step)
        misses = [k for k in step if k not in policy.slot_of]
        if misses:
            slots = policy.victims(len(misses), set(step))
            assert len(set(slots)) == len(slots) == len(misses)
            assert not {policy.holder[s] for s in slots} & set(step)
            for slot, key in zip(slots, misses):
                policy.place(slot, key)
        assert set(policy.slot_of) == set(lru.resident) == set(policy.recency)


def test_a_prefill_wave_larger_than_the_shadows_leaves_them_working() -> None:
    """A cache beyond SHADOW_SLOTS samples layers for its shadows, which hold fewer experts than
    a long prompt's wave of one layer: such a wave skips them, and the decode after it goes on
    (the frequency shadow shares the scores that wave moved)."""
    n_expert, layers = 384, 4
    n_slots = SHADOW_SLOTS + 1
    policy = CachePolicy(n_slots)
    rng = random.Random(0)
    decode = lambda: [[ExpertKey(l, e) for e in rng.sample(range(n_expert), 8)] for l in range(layers)]
    for _ in range(50):
        drive(policy, decode())
    drive(policy, [[ExpertKey(l, e) for e in range(n_expert)] for l in range(layers)])  # one wave a layer
    for _ in range(50):
        drive(policy, decode())
    assert len(policy.slot_of) == n_slots


def test_the_shadows_sample_layers_in_the_order_first_seen() -> None:
    """Layers numbered oddly (MoE on odd layers only) still feed the shadows."""
    n_slots = 2 * SHADOW_SLOTS  # stride 2
    policy = CachePolicy(n_slots)
    old = [ExpertKey(1, i) for i in range(8)]
    drive(policy, [old[:4], old[4:]] * 40)
    assert policy.lead[0] > 0 and policy.lead[1] > 0
