"""The RAM tier: expert blocks kept resident in the shared segment, after the staging slots, for
every client. A RAM hit is a slot reference to the resident block (no read, no copy); a block read
on a miss lands straight in a RAM slot when the policy admits it, and every client asking for that
key meanwhile waits on that one read. Each RAM slot moves EMPTY -> READING -> RESIDENT -> EMPTY
(READING -> EMPTY when its read fails or its block is corrupt), checked on every move; a RESIDENT
block is only evicted while no client holds it (holds are counted: READY adds one, RELEASE or the
client's end takes it back) and no check of its bytes runs. A resident block found altered
(the scheduler checks it at every hit) is condemned: out of the index at once, so that no hit
finds it and its key may be read again, and EMPTY once nobody holds it (RESIDENT -> CONDEMNED ->
EMPTY). Which block leaves is RamPolicy's choice. Knows nothing of sockets, reads or the pack's
bytes: the server drives it.

Why inside the staging segment: the worker maps the whole segment and registers it with CUDA, so a
READY that names a RAM slot is DMA'd by the GPU from where the block rests, with the same
`slot * slot_bytes` addressing as a staging slot. RAM slots are `slot_bytes` (the pack's largest
stride) each, so a pack whose layers differ in stride leaves the difference unused."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from expertpack.packtools.layout import ExpertKey

from .ram_policy import RamPolicy
from .staging import IllegalTransition, StagingError

GIB = 1 << 30
# The default budget (ram_cache_gib unset): this share of the memory the host has available at
# start, after the staging and RAM_MARGIN_BYTES are set aside for the worker, the page tables and
# everything else the host runs, and never more than the whole pack.
RAM_DEFAULT_SHARE = 0.5
RAM_MARGIN_BYTES = 2 * GIB


class RamBudgetError(StagingError):
    """ram_cache_gib asks for more memory than the host has available beside the staging."""


class RamState(Enum):
    EMPTY = "empty"
    READING = "reading"
    RESIDENT = "resident"
    CONDEMNED = "condemned"  # its bytes no longer match its crc32; held still, never named again


TRANSITIONS: dict[RamState, frozenset[RamState]] = {
    RamState.EMPTY: frozenset({RamState.READING}),
    RamState.READING: frozenset({RamState.RESIDENT, RamState.EMPTY}),
    RamState.RESIDENT: frozenset({RamState.EMPTY, RamState.CONDEMNED}),
    RamState.CONDEMNED: frozenset({RamState.EMPTY}),
}


@dataclass
class RamSlot:
    index: int  # the slot's number in the segment (after the staging slots)
    state: RamState = RamState.EMPTY
    key: ExpertKey | None = None
    nbytes: int = 0  # the payload resident (or being read)
    holds: int = 0  # READYs naming this slot not yet released, over all clients
    checking: bool = False  # the scrub is checking its bytes: it is not evicted meanwhile

    def move(self, new: RamState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"RAM slot {self.index}: {self.state.name} -> {new.name} is not allowed "
                                    f"(from {self.state.name}: {sorted(s.name for s in TRANSITIONS[self.state])})")
        self.state = new


def ram_slot_count(requested_gib: float | None, slot_bytes: int, staging_bytes: int, available_bytes: int,
                   n_blocks: int) -> tuple[int, str]:
    """RAM slots for a budget of `requested_gib` (None: the default share of `available_bytes`),
    never more than the pack's `n_blocks`, and why that many. A budget beyond what the host has
    available beside the staging is refused (RamBudgetError), even where the pack is smaller: the
    setting is wrong for this host."""
    if requested_gib is not None and staging_bytes + requested_gib * GIB > available_bytes:
        fit = max(0, available_bytes - staging_bytes) / GIB
        raise RamBudgetError(f"ram_cache_gib = {requested_gib:g} asks for {int(requested_gib * GIB):,} bytes beside "
                             f"{staging_bytes:,} bytes of staging, but the host has {available_bytes:,} bytes available; "
                             f"lower ram_cache_gib (at most {fit:.3f} fit now)")
    if requested_gib is None:
        budget = max(0, int((available_bytes - staging_bytes - RAM_MARGIN_BYTES) * RAM_DEFAULT_SHARE))
        why = (f"default: {RAM_DEFAULT_SHARE:g} of what the staging and a {RAM_MARGIN_BYTES // GIB} GiB margin leave "
               f"of the {available_bytes:,} bytes available")
    else:
        budget = int(requested_gib * GIB)
        why = f"ram_cache_gib = {requested_gib:g}"
    slots = budget // slot_bytes
    if slots > n_blocks:
        return n_blocks, f"{why}, capped at the whole pack ({n_blocks} blocks)"
    return slots, why


class RamClaim(NamedTuple):
    slot: RamSlot  # READING, to be filled with the new key
    evicted: ExpertKey | None  # the block that left it, if it was not empty


@dataclass
class RamTier:
    first_slot: int  # RAM slot i is segment slot first_slot + i
    n_slots: int
    policy: RamPolicy = field(init=False)
    slots: list[RamSlot] = field(init=False)
    slot_of: dict[ExpertKey, RamSlot] = field(default_factory=dict)  # RESIDENT or READING
    resident_bytes: int = 0
    _empty: list[int] = field(init=False, repr=False)  # EMPTY slots' indices, the lowest last

    def __post_init__(self) -> None:
        self.slots = [RamSlot(self.first_slot + i) for i in range(self.n_slots)]
        self.policy = RamPolicy(self.n_slots)
        self._empty = [s.index for s in reversed(self.slots)]

    def owns(self, index: int) -> bool:
        return self.first_slot <= index < self.first_slot + self.n_slots

    def slot(self, index: int) -> RamSlot:
        return self.slots[index - self.first_slot]

    def lookup(self, key: ExpertKey) -> RamSlot | None:
        """The slot holding `key` or being filled with it, if any."""
        return self.slot_of.get(key)

    def touch(self, keys: tuple[ExpertKey, ...] | list[ExpertKey]) -> None:
        """Clients asked for these keys (hits and misses alike): their frequency grows."""
        if self.n_slots:
            self.policy.touch(keys)

    def claim(self, key: ExpertKey, nbytes: int) -> RamClaim | None:
        """A slot to read `key` into (moved to READING) and the key evicted from it, or None when the
        policy does not admit `key`: no EMPTY slot, and no RESIDENT block that nobody holds and that
        is asked for no more often than `key`."""
        if not self.n_slots or key in self.slot_of:
            return None
        victim: ExpertKey | None = None
        if self._empty:
            slot = self.slot(self._empty.pop())
        else:
            victim = self.policy.victim(key, evictable=lambda k: self.slot_of[k].holds == 0
                                        and self.slot_of[k].state is RamState.RESIDENT
                                        and not self.slot_of[k].checking)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            self.policy.forget(victim)
            slot.move(RamState.EMPTY)
            self.resident_bytes -= slot.nbytes
        slot.move(RamState.READING)
        slot.key = key
        slot.nbytes = nbytes
        self.slot_of[key] = slot
        self.policy.admit(key)
        return RamClaim(slot, victim)

    def filled(self, slot: RamSlot, ok: bool) -> None:
        """The read into `slot` finished: resident when its bytes are good (read whole and checked),
        empty again otherwise (nothing of a failed or corrupt read is ever served)."""
        if ok:
            slot.move(RamState.RESIDENT)
            self.resident_bytes += slot.nbytes
            return
        slot.move(RamState.EMPTY)
        assert slot.key is not None and slot.holds == 0
        del self.slot_of[slot.key]
        self.policy.forget(slot.key)
        self._vacate(slot)

    def condemn(self, slot: RamSlot) -> None:
        """The RESIDENT block in `slot` no longer matches its crc32 (written by someone else): out of
        the index now (no hit finds it, its key may be read into another slot), EMPTY now if nobody
        holds it, else once the last hold ends."""
        assert slot.key is not None and not slot.checking
        del self.slot_of[slot.key]
        self.policy.forget(slot.key)
        self.resident_bytes -= slot.nbytes
        if slot.holds:
            slot.move(RamState.CONDEMNED)
        else:
            slot.move(RamState.EMPTY)
            self._vacate(slot)

    def _vacate(self, slot: RamSlot) -> None:
        """`slot`, EMPTY now, is free for the next claim."""
        slot.key = None
        slot.nbytes = 0
        self._empty.append(slot.index)

    def hold(self, slot: RamSlot) -> None:
        if slot.state is not RamState.RESIDENT:
            raise IllegalTransition(f"RAM slot {slot.index}: only a RESIDENT block may be held, it is {slot.state.name}")
        slot.holds += 1

    def unhold(self, slot: RamSlot, n: int = 1) -> None:
        """Ends `n` holds; a condemned block is emptied with its last."""
        if slot.holds < n:
            raise IllegalTransition(f"RAM slot {slot.index}: {n} holds released, {slot.holds} held")
        slot.holds -= n
        if slot.state is RamState.CONDEMNED and not slot.holds:
            slot.move(RamState.EMPTY)
            self._vacate(slot)

    def count(self, state: RamState) -> int:
        return sum(1 for s in self.slots if s.state is state)

    @property
    def held(self) -> int:
        return sum(1 for s in self.slots if s.holds)
