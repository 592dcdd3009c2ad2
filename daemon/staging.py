"""The shared staging: one POSIX shared-memory segment (/dev/shm, locked in RAM), carved into slots
of one expert block each, where O_DIRECT reads land and clients read from. Mode 0640: expertd's
group (the workers) may map it to read, only expertd writes it (a client that could write a RAM
tier block would hand its bytes to every other client). The RAM
tier's slots (ram_tier.py) follow the staging slots in the same segment, so that the one mapping a
client registers with CUDA covers both; they are locked where the memlock limit allows, and
served unlocked (said once in the log and in STATS) where it does not. Each staging slot
moves FREE -> READING -> READY -> LEASED -> FREE (READING -> FREE and READY -> FREE when a read
fails or its client is gone), checked on every move. Slots are leased to clients in sets; only the
lessee's requests use a slot. Knows nothing of sockets or the pack."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import secrets
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import psutil

from expertpack.packtools.layout import ALIGNMENT as SLOT_ALIGNMENT  # O_DIRECT lands in slots

SHM_DIR = Path("/dev/shm")
SEGMENT_MODE = 0o640  # the workers' group reads, only expertd writes


class StagingError(RuntimeError):
    """The staging segment cannot be created, locked or aligned; the message says how to fix it."""


class SlotState(Enum):
    FREE = "free"
    READING = "reading"
    READY = "ready"
    LEASED = "leased"


TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.FREE: frozenset({SlotState.READING}),
    SlotState.READING: frozenset({SlotState.READY, SlotState.FREE}),
    SlotState.READY: frozenset({SlotState.LEASED, SlotState.FREE}),
    SlotState.LEASED: frozenset({SlotState.FREE}),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Slot:
    index: int
    offset: int  # in the segment
    state: SlotState = SlotState.FREE
    lessee: bytes | None = None  # the client this slot is leased to

    def move(self, new: SlotState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"slot {self.index}: {self.state.name} -> {new.name} is not allowed "
                                    f"(from {self.state.name}: {sorted(s.name for s in TRANSITIONS[self.state])})")
        self.state = new


@dataclass
class SlotPool:
    slots: list[Slot]
    _unleased: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._unleased = [s.index for s in reversed(self.slots)]

    def lease(self, client: bytes, n: int) -> list[int] | None:
        """n slots for `client`, or None when fewer than n are unleased."""
        if len(self._unleased) < n:
            return None
        got = [self._unleased.pop() for _ in range(n)]
        for i in got:
            self.slots[i].lessee = client
        return got

    def give_back(self, index: int) -> None:
        """Ends a slot's lease; the slot must be FREE (an in-flight read gives it back when done)."""
        slot = self.slots[index]
        if slot.state is not SlotState.FREE or slot.lessee is None:
            raise IllegalTransition(f"slot {index}: cannot end the lease of a slot that is {slot.state.name} "
                                    f"and leased to {slot.lessee!r}")
        slot.lessee = None
        self._unleased.append(index)

    @property
    def n_unleased(self) -> int:
        return len(self._unleased)

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots if s.state is state)


def remove_orphans() -> list[Path]:
    """Unlinks the segments of expertd processes that no longer exist (a SIGKILL or a power cut
    leaves them in /dev/shm, holding RAM). A worker still mapping one keeps its mapping."""
    removed = []
    for path in SHM_DIR.glob("expertpack-*-*"):
        try:
            pid = int(path.name.split("-")[1])
            os.kill(pid, 0)
        except ValueError:
            continue  # not a name this daemon makes
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
        except PermissionError:
            pass  # alive, another user's
    return removed


def lockable_bytes() -> tuple[int, str]:
    """What the host can give the staging now, and what bounds it: the RAM available and the free
    space of /dev/shm, whichever is smaller."""
    available = int(psutil.virtual_memory().available)
    shm = os.statvfs(SHM_DIR)
    shm_free = shm.f_bavail * shm.f_frsize
    if shm_free < available:
        return shm_free, f"{SHM_DIR} has {shm_free:,} bytes free"
    return available, f"the host has {available:,} bytes of memory available"


class StagingSegment:
    """Creates (O_EXCL), maps and mlocks the segment: `n_slots` staging slots, then `ram_slots` RAM
    tier slots, all `slot_bytes` long. The staging must lock (fail-closed); the RAM tier is locked
    if the memlock limit allows (`ram_locked`, and why not in `ram_lock_error`). `close` unmaps and
    unlinks it."""

    def __init__(self, n_slots: int, slot_bytes: int, name: str | None = None, ram_slots: int = 0) -> None:
        if slot_bytes % SLOT_ALIGNMENT:
            raise StagingError(f"slot size {slot_bytes} is not a multiple of {SLOT_ALIGNMENT}")
        limit, why = lockable_bytes()
        if n_slots * slot_bytes > limit:
            raise StagingError(f"stage_slots {n_slots} x {slot_bytes:,}-byte slots need {n_slots * slot_bytes:,} "
                               f"bytes of locked memory, but {why}; lower stage_slots (at most "
                               f"{limit // slot_bytes} fit now)")
        if (n_slots + ram_slots) * slot_bytes > limit:
            fit_gib = (limit - n_slots * slot_bytes) // slot_bytes * slot_bytes / 2**30
            raise StagingError(f"ram_cache_gib asks for {ram_slots} RAM slots of {slot_bytes:,} bytes "
                               f"({ram_slots * slot_bytes:,} bytes) beside {n_slots * slot_bytes:,} bytes of staging, "
                               f"but {why}; lower ram_cache_gib (at most {fit_gib:.3f} fit now)")
        self.name = name or f"expertpack-{os.getpid()}-{secrets.token_hex(4)}"
        self.slot_bytes = slot_bytes
        self.staging_bytes = n_slots * slot_bytes
        self.size_bytes = (n_slots + ram_slots) * slot_bytes
        self.ram_locked = False
        self.ram_lock_error: str | None = None
        self.path = SHM_DIR / self.name
        self.map: mmap.mmap | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, SEGMENT_MODE)
        # From here every way out but success removes the segment: an error, and also SIGTERM or
        # Ctrl-C (KeyboardInterrupt) during the seconds that locking gigabytes takes.
        try:
            try:
                os.fchmod(fd, SEGMENT_MODE)  # whatever the umask
                os.ftruncate(fd, self.size_bytes)
                self.map = mmap.mmap(fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise StagingError(f"cannot create {self.size_bytes:,} bytes of staging in {self.path}: "
                                   f"{exc.strerror} (is /dev/shm large enough? lower stage_slots)") from None
            finally:
                os.close(fd)
            self._anchor = ctypes.c_char.from_buffer(self.map)
            self.address = ctypes.addressof(self._anchor)
            if self.address % SLOT_ALIGNMENT:
                raise StagingError(f"staging mapped at {self.address:#x}, not {SLOT_ALIGNMENT}-aligned")
            _mlock(self.address, self.staging_bytes)
            if ram_slots:
                self.ram_lock_error = _try_mlock(self.address + self.staging_bytes, ram_slots * slot_bytes)
                self.ram_locked = self.ram_lock_error is None
        except BaseException:
            self.close()
            raise
        self.pool = SlotPool([Slot(i, i * slot_bytes) for i in range(n_slots)])

    def view(self, slot: int, start: int = 0, end: int | None = None) -> memoryview:
        base = slot * self.slot_bytes
        return memoryview(self.map)[base + start: base + (self.slot_bytes if end is None else end)]

    def close(self) -> None:
        if getattr(self, "_anchor", None) is not None:
            del self._anchor
            self._anchor = None
        if self.map is not None and not self.map.closed:
            try:
                self.map.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process
        self.path.unlink(missing_ok=True)


def _try_mlock(address: int, size: int) -> str | None:
    """mlock; None when it worked, else why not (the strerror)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _mlock(address: int, size: int) -> None:
    err = _try_mlock(address, size)
    if err is not None:
        raise StagingError(
            f"cannot lock {size:,} bytes of staging in RAM: {err}. Raise the memlock limit "
            "(systemd: LimitMEMLOCK=infinity; shell: ulimit -l unlimited) or lower stage_slots")
