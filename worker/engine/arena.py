"""The engine's KV memory: sequence slots, each a KVCache whose buffers belong to the slot for the
engine's life. A request holds a Sequence, a handle to one slot, never buffers of its own. When a
sequence closes (or is dropped), its slot is cleared, not freed: the next sequence in it writes over
its rows and finds its states reset in place. So the graphs captured over a slot's buffers stay
valid for every sequence that runs there, and nothing is traded between requests to keep them so.

A slot is taken by one live sequence at a time; sequences alive together (a test comparing two
runs, expert-worker's batch) get slots of their own. The arena knows nothing of graphs or models."""

from __future__ import annotations

import weakref

from ..nn.layers import KVCache


class SequenceClosed(RuntimeError):
    """A closed sequence was used: its slot may already hold another sequence's rows."""


class Sequence:
    """One sequence's handle: its slot in the arena and the KVCache there. `close()` (or leaving a
    `with` block, or dropping the last reference) gives the slot back."""

    def __init__(self, arena: "KVArena", slot: int) -> None:
        self.slot = slot
        self._kv: KVCache | None = arena.slots[slot]
        self._release = weakref.finalize(self, arena._release, slot)

    @property
    def kv(self) -> KVCache:
        if self._kv is None:
            raise SequenceClosed(f"sequence in slot {self.slot} was closed; open a new one (engine.new_sequence())")
        return self._kv

    @property
    def length(self) -> int:
        """Tokens the sequence holds."""
        return self.kv.length

    def close(self) -> None:
        self._kv = None
        self._release()

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVArena:
    """Slots made as sequences need them and kept: `slots[i]` is the same KVCache for the arena's
    life, its buffers grown only when a sequence outgrows them (KVCache.generation counts that)."""

    def __init__(self) -> None:
        self.slots: list[KVCache] = []
        self._free: list[int] = []

    def open(self) -> Sequence:
        """A sequence in a free slot, the lowest first (a server's lone request always gets slot 0,
        and the graphs captured there), its rows and states cleared."""
        if self._free:
            self._free.sort(reverse=True)
            slot = self._free.pop()
        else:
            self.slots.append(KVCache())
            slot = len(self.slots) - 1
        self.slots[slot].clear()
        return Sequence(self, slot)

    @property
    def in_use(self) -> int:
        return len(self.slots) - len(self._free)

    def _release(self, slot: int) -> None:
        self._free.append(slot)
