"""The RAM tier's bookkeeping without a daemon: fading LFU with LRU among equals, admission only over
a victim asked for no more often, held, READING and checked blocks never evicted, a condemned block
out of the index at once and empty with its last hold, checked slot moves, and the budget's sizing."""

from __future__ import annotations

import pytest

from expertpack.daemon.ram_policy import RamPolicy
from expertpack.daemon.ram_tier import (
    GIB, RAM_DEFAULT_SHARE, RAM_MARGIN_BYTES, RamBudgetError, RamState, RamTier, ram_slot_count,
)
from expertpack.daemon.staging import IllegalTransition
from expertpack.packtools.layout import ExpertKey

A, B, C, D = (ExpertKey(0, e) for e in range(4))


def fill(tier: RamTier, *keys: ExpertKey) -> None:
    for k in keys:
        tier.touch([k])
        claim = tier.claim(k, 100)
        assert claim is not None, k
        tier.filled(claim.slot, ok=True)


def test_a_cold_key_does_not_flush_a_hot_one() -> None:
    tier = RamTier(first_slot=10, n_slots=1)
    fill(tier, A)
    for _ in range(5):
        tier.touch([A])
    tier.touch([B])  # asked for once, after A was asked for six times
    assert tier.claim(B, 100) is None
    assert tier.lookup(A) is not None and tier.lookup(A).index == 10


def test_the_least_asked_for_goes_first_and_the_oldest_among_as_many() -> None:
    tier = RamTier(first_slot=0, n_slots=2)
    fill(tier, A, B)  # one request each; A's is older, so its faded count is lower
    tier.touch([C])
    claim = tier.claim(C, 100)
    assert claim is not None and claim.evicted == A and tier.lookup(A) is None
    policy = RamPolicy(2)  # frequency beats recency: A asked for three times, then B once
    for k in (A, A, A, B):
        policy.touch([k])
        policy.admit(k)
    policy.touch([C])
    assert policy.victim(C, evictable=lambda k: True) == B
    assert policy.victim(C, evictable=lambda k: k != B) is None  # A is asked for more than C


def test_held_and_reading_blocks_are_never_evicted() -> None:
    tier = RamTier(first_slot=0, n_slots=2)
    fill(tier, A)
    tier.touch([B])
    reading = tier.claim(B, 100)
    assert reading is not None and reading.slot.state is RamState.READING
    tier.hold(tier.lookup(A))
    for _ in range(10):
        tier.touch([C])
    assert tier.claim(C, 100) is None  # A is held, B is being read
    tier.unhold(tier.lookup(A))
    claim = tier.claim(C, 100)
    assert claim is not None and claim.evicted == A


def test_a_failed_read_leaves_nothing_behind() -> None:
    tier = RamTier(first_slot=0, n_slots=1)
    tier.touch([A])
    claim = tier.claim(A, 100)
    tier.filled(claim.slot, ok=False)
    assert tier.lookup(A) is None and claim.slot.state is RamState.EMPTY and tier.resident_bytes == 0
    fill(tier, B)
    assert tier.resident_bytes == 100


def test_a_block_under_check_is_not_evicted_and_a_condemned_one_empties_with_its_last_hold() -> None:
    tier = RamTier(first_slot=0, n_slots=2)
    fill(tier, A, B)
    tier.lookup(A).checking = True
    tier.lookup(B).checking = True
    for _ in range(10):
        tier.touch([C])
    assert tier.claim(C, 100) is None  # both are being checked
    slot_a, slot_b = tier.lookup(A), tier.lookup(B)
    slot_a.checking = slot_b.checking = False
    tier.hold(slot_a)
    tier.condemn(slot_a)  # held: out of the index, its slot not free yet
    tier.condemn(slot_b)  # not held: empty at once
    assert tier.lookup(A) is None and slot_a.state is RamState.CONDEMNED and tier.resident_bytes == 0
    assert tier.lookup(B) is None and slot_b.state is RamState.EMPTY
    with pytest.raises(IllegalTransition, match="only a RESIDENT block may be held"):
        tier.hold(slot_a)
    fill(tier, A)  # read again, into the empty slot
    assert tier.lookup(A) is slot_b
    tier.unhold(slot_a)
    assert slot_a.state is RamState.EMPTY and slot_a.key is None
    fill(tier, C)
    assert tier.lookup(C) is slot_a


def test_slot_moves_are_checked() -> None:
    tier = RamTier(first_slot=0, n_slots=1)
    tier.touch([A])
    claim = tier.claim(A, 100)
    with pytest.raises(IllegalTransition, match="only a RESIDENT block may be held"):
        tier.hold(claim.slot)
    tier.filled(claim.slot, ok=True)
    with pytest.raises(IllegalTransition, match="RESIDENT -> RESIDENT"):
        tier.filled(claim.slot, ok=True)
    with pytest.raises(IllegalTransition, match="1 holds released, 0 held"):
        tier.unhold(claim.slot)


def test_no_tier_admits_nothing() -> None:
    tier = RamTier(first_slot=8, n_slots=0)
    tier.touch([A])
    assert tier.claim(A, 100) is None and tier.lookup(A) is None and not tier.owns(8)


def test_budget_sizing() -> None:
    slot = 1 << 20
    assert ram_slot_count(0, slot, 0, 64 * GIB, 1000) == (0, "ram_cache_gib = 0")
    assert ram_slot_count(0.5, slot, 0, 64 * GIB, 1000)[0] == 512
    slots, why = ram_slot_count(2, slot, 0, 64 * GIB, 1000)
    assert slots == 1000 and "capped at the whole pack" in why
    available, staging = 10 * GIB, GIB
    slots, why = ram_slot_count(None, slot, staging, available, 1 << 30)
    assert slots == int((available - staging - RAM_MARGIN_BYTES) * RAM_DEFAULT_SHARE) // slot and "default" in why
    assert ram_slot_count(None, slot, staging, GIB, 1 << 30)[0] == 0  # less than the margin: no tier
    with pytest.raises(RamBudgetError, match=r"lower ram_cache_gib \(at most 9.000 fit now\)"):
        ram_slot_count(9.5, slot, staging, available, 4)  # beyond the host, though the pack is smaller
