"""The key path of expertd: each session's queued keys, demand before prefetch, to reads and to
their one answer (READY or FAIL), and the RAM tier (ram_tier.py, protocol v3) in front of the reads.

A key resident in the tier is answered at once with READY naming its RAM slot (a hold, ended by
RELEASE like a lease); a key being read into the tier waits for that read; a miss the policy admits
is read into a RAM slot instead of the client's staging slot, and is resident for everyone once its
crc32 check passed; any other miss gets one of the client's leased staging slots. A client holds at
most its RAM hold share of blocks and has at most as many reads into the tier in flight as it
leases staging slots, so one client cannot pin the tier nor take every reader. Its PREFETCH keys
take at most the protocol's prefetch budget of each (holds, reads, staging slots), whatever the
client sends: the rest stays for its demand, which its prefetches therefore never hold up (its own
demand's holds are its to give back: the worker does so before a fetch runs out of them).
Each reader thread checksums the piece it read; once every piece is in, their crc32s joined
(block_crc.py) are the block's, checked against the manifest's (packs of format 1.1); only then
does READY name the slot: a block that fails the check is FAILed CORRUPT to every key that waited
on it, counted and logged once by (layer, expert), and every other key is served on. A read that
comes back short because the pack was truncated under expertd is FAILed TRUNCATED (protocol v7),
naming the pack's size now and its manifest's.
Resident blocks are scrubbed: while no read is in flight and some client holds a session (an
expertd nobody uses rests), one at a time and at most SCRUB_BYTES_PER_S,
a block's bytes are checked against its crc32 again on a reader thread. Only expertd writes the
segment (clients map it read-only), so a block that fails this was written by a process of
expertd's own user or hit by a memory fault: it is counted in corrupt_blocks, condemned
(ram_tier.py) and read again from the pack for its next hit; the clients that keep it (protocol
v8: their GPU reads it in place) are told, CONDEMNED. Hits are not held for the scrub: a
check on every hit cost 30% of streaming decode (BENCHMARKS.md), and a GPU that reads tier blocks
in place reads them past any check expertd could make as they leave.
Runs on the main loop's thread, but for `_on_read_done` (a reader thread's hand-over through an
eventfd); it never reads a socket, and sends only answers, through `send`."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey, LayerLayout, format_crc32

from .block_crc import CrcJoiner
from .config import DaemonConfig
from .ram_tier import RamSlot, RamState, RamTier
from .reader import CorruptBlock, OpenPack, ReaderPool, ReadJob, ShortRead
from .sessions import Request, Session, Work
from .staging import SlotState, StagingSegment
from .stats import Counters, Histogram

log = logging.getLogger("expertd")


SCRUB_BYTES_PER_S = 32 << 20  # a 4 GiB tier in ~2 minutes, ~3% of a core at zlib's crc32 speed
SCRUB_MIN_INTERVAL_S = 0.02  # tiny blocks: at most 50 checks a second
SCRUB_PRIO = int(p.Priority.PREFETCH) + 1  # behind every read


@dataclass(eq=False)
class RamCheck:
    """A scrub's check of one resident RAM block's bytes against its crc32, on the reader threads."""

    slot: RamSlot
    key: ExpertKey
    pieces_left: int = 0
    piece_crc32s: list[int | None] = field(default_factory=list)
    error: BaseException | None = None


def _room(share: int, prefetch: bool) -> int:
    """How much of a client's share (RAM holds, reads into the tier, staging slots) a key may find in
    use and still start: all of it for demand, the protocol's prefetch budget for a prefetch (a
    client of one slot's prefetches wait until promoted or cancelled)."""
    return p.prefetch_budget(share) if prefetch else share


class Scheduler:
    def __init__(self, config: DaemonConfig, pack: OpenPack, layers: dict[int, LayerLayout],
                 staging: StagingSegment, ram: RamTier, counters: Counters,
                 send: Callable[[bytes, p.Message], None]) -> None:
        self.config = config
        self.pack = pack
        self.layers = layers
        self.staging = staging
        self.ram = ram
        self.counters = counters
        self._send = send
        self.on_condemned: Callable[[int], None] = lambda index: None  # a RAM slot failed the scrub (the server tells its keepers)
        self.has_clients: Callable[[], bool] = lambda: True  # whether anyone holds a session (the scrub rests otherwise)
        self.read_latency = Histogram()
        self.fetch_latency = Histogram()
        self.check_crc32 = pack.manifest.has_crc32
        if not self.check_crc32:
            log.warning("%s was built before pack format 1.1 and has no block crc32s: blocks are served without "
                        "a check as they are read (`expertpack verify` checks their sha256; a rebuild adds the "
                        "crc32s)", config.pack)
        # Per layer, how many payload bytes of each read piece are checksummed (0: a piece of padding)
        self._crc_bytes = {l.layer: tuple(max(0, min(length, l.payload_bytes - start))
                                          for start, length in pack.splits[l.layer])
                           for l in layers.values()} if self.check_crc32 else {}
        self._crc_joiner = CrcJoiner(n for lengths in self._crc_bytes.values() for n in lengths if n)
        self._waiting: dict[int, list[Work]] = {}  # RAM slot being read -> the keys answered when it is in
        self._reading = 0  # blocks being read (staging or tier): the scrub waits for none
        self._scrub: RamCheck | None = None  # the resident block whose bytes are being checked
        self._scrub_next = 0.0  # time.monotonic() at which the next scrub may start
        self._scrub_cursor = 0  # the RAM slot the scrub looks at next
        self._completions: queue.SimpleQueue[tuple[ReadJob, BaseException | None, int]] = queue.SimpleQueue()
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the main loop polls it
        try:
            self.readers = ReaderPool(pack.fd, config.read_threads, self._on_read_done)
        except BaseException:
            os.close(self.wake)
            raise

    # ---- keys in -----------------------------------------------------------------------------
    def submit(self, session: Session, request_id: int, keys: tuple[ExpertKey, ...], prio: p.Priority) -> None:
        """Queues a FETCH's keys (already checked) and starts what the client has room for."""
        now = time.monotonic_ns()
        works = [Work(session, request_id, key, prio, now) for key in keys]
        session.requests[request_id] = Request(works, len(works))
        session.pending[prio].extend(works)
        session.queued += len(works)
        self.counters.fetches += 1
        self.counters.keys += len(works)
        session.counters.fetches += 1
        session.counters.keys += len(works)
        self.ram.touch(keys)
        self.dispatch(session)

    def cancel(self, session: Session, request: Request) -> None:
        """CANCEL: the request's keys still queued are FAILed CANCELLED now; those being read, once
        their read is in (their slot comes back then)."""
        for work in request.works:
            if work.done or work.cancelled:
                continue
            work.cancelled = True
            if work.slot is None:  # still queued: answer now
                self.finish(work, p.FailCode.CANCELLED, "cancelled")
        # Answered keys leave the queues now, so repeated FETCH + CANCEL cannot grow them.
        session.pending = tuple(deque(w for w in q if not w.done) for q in session.pending)

    def promote(self, session: Session, request: Request) -> None:
        """PROMOTE (v5): the request's keys not answered yet go at DEMAND priority: those still in
        the client's queue move to its demand queue (behind the demand already there), those being
        read move up the readers' queue, and so does the read a key waits on in the RAM tier."""
        promoted = [w for w in request.works if not w.done and not w.cancelled and w.prio is not p.Priority.DEMAND]
        for work in promoted:
            work.prio = p.Priority.DEMAND
            if work.slot is None:
                continue  # still queued: moved below
            reader = self._waiting.get(work.slot, [work])[0] if work.ram else work  # whose read fills the slot
            reader.prio = p.Priority.DEMAND
            self.readers.promote(reader, int(p.Priority.DEMAND))
        queued = {id(w) for w in promoted if w.slot is None}
        if queued:
            demand, prefetch = session.pending
            session.pending = (deque([*demand, *(w for w in prefetch if id(w) in queued)]),
                               deque(w for w in prefetch if id(w) not in queued))
            self.dispatch(session)

    def dispatch(self, session: Session) -> None:
        """Answers or starts the session's queued keys in order, demand first, until one needs a
        staging slot (or a RAM hold) the client does not have free, or the session ends: a RAM hit
        is answered at once, and a client found unreachable then is dropped (sessions.py) while
        this loop runs; nothing more may start for it (each start would pin a block for nobody)."""
        while not session.closed:
            demand, prefetch = session.pending  # a drop replaces them: read anew each turn
            if not (demand or prefetch):
                return
            queue_ = demand if demand else prefetch
            if not queue_[0].done and not self._start(session, queue_[0]):
                return
            queue_.popleft()

    def _start(self, session: Session, work: Work) -> bool:
        """A RAM hit is answered now; a key being read into the RAM tier waits for that read; a
        miss is read into a RAM slot if the policy admits it, else into a free staging slot of the
        client. False when none of these can happen yet: the client holds its share of the tier
        (it must RELEASE), has its share of reads into it in flight, or has no staging slot free; a
        prefetch, when it would take more than its budget of any of them (the rest is its demand's)."""
        prefetch = work.prio is not p.Priority.DEMAND
        n_slots = len(session.slots)
        hold_room = _room(session.ram_share, prefetch)
        read_room = _room(n_slots, prefetch)
        resident = self.ram.lookup(work.key)
        if resident is not None:
            if session.ram_taken >= hold_room:
                return False
            work.slot, work.ram = resident.index, True
            session.ram_taken += 1
            self._hit(session)
            if resident.state is RamState.RESIDENT:
                self._ready_ram(work, resident)
                return True
            waiting = self._waiting[resident.index]
            reader = waiting[0]  # the key whose read fills the slot
            if work.prio < reader.prio:  # demand joins a prefetch's read: it goes at demand priority now
                reader.prio = work.prio
                self.readers.promote(reader, int(work.prio))
            waiting.append(work)
            return True
        if self.ram.n_slots:
            if session.ram_taken >= hold_room or session.ram_reads >= read_room:
                return False  # a read or a RELEASE of its own lets it on; the key may still be admitted then
            claim = self.ram.claim(work.key, self.layers[work.key.layer].payload_bytes)
            if claim is not None:
                self.counters.ram_misses += 1
                session.counters.ram_misses += 1
                self.counters.ram_evictions += claim.evicted is not None
                session.ram_reads += 1
                work.slot, work.ram = claim.slot.index, True
                session.ram_taken += 1
                self._waiting[claim.slot.index] = [work]
                self._read(work)
                return True
        if n_slots - len(session.free) >= read_room:  # the staging slots in use: none free, or its budget for a prefetch
            return False
        self.counters.ram_misses += 1
        session.counters.ram_misses += 1
        slot = session.free.popleft()
        self.staging.pool.slots[slot].move(SlotState.READING)
        work.slot = slot
        self._read(work)
        return True

    def _hit(self, session: Session) -> None:
        """A key answered from the tier without a read of its own (resident and intact, or joining a read)."""
        self.counters.ram_hits += 1
        session.counters.ram_hits += 1

    # ---- the scrub of resident blocks ----------------------------------------------------------
    def scrub_wait_s(self, now: float) -> float | None:
        """Seconds until the scrub may check another block (the main loop wakes then), None while
        it has nothing to do: no crc32s, nothing resident, or no client to serve (an idle expertd
        rests; a block altered meanwhile is found once a client is back, before or after its hits)."""
        if not self.check_crc32 or not self.ram.resident_bytes or not self.has_clients():
            return None
        return max(0.0, self._scrub_next - now)

    def scrub(self, now: float) -> None:
        """Starts the check of the next resident block, when one is due, none is in flight and no
        read is: the scrub never competes with a read for a reader thread or the disk's time."""
        if (not self.check_crc32 or self._scrub is not None or self._reading or now < self._scrub_next
                or not self.ram.resident_bytes or not self.has_clients()):
            return
        slot = self._next_resident()
        if slot is None:
            return
        assert slot.key is not None
        check = self._scrub = RamCheck(slot, slot.key)
        slot.checking = True
        layer = self.layers[slot.key.layer]
        pieces = [(start, n) for (start, _), n in zip(self.pack.splits[layer.layer], self._crc_bytes[layer.layer]) if n]
        check.pieces_left = len(pieces)
        check.piece_crc32s = [None] * len(pieces)
        for i, (start, n) in enumerate(pieces):
            self.readers.submit_check(SCRUB_PRIO, self.staging.view(slot.index, start, start + n), check, piece=i)
        self._scrub_next = now + max(SCRUB_MIN_INTERVAL_S, layer.payload_bytes / SCRUB_BYTES_PER_S)

    def _next_resident(self) -> RamSlot | None:
        """The next RESIDENT slot from the scrub's cursor on, round the tier."""
        slots = self.ram.slots
        for _ in range(len(slots)):
            slot = slots[self._scrub_cursor]
            self._scrub_cursor = (self._scrub_cursor + 1) % len(slots)
            if slot.state is RamState.RESIDENT:
                return slot
        return None

    def _check_piece_done(self, job: ReadJob, error: BaseException | None) -> None:
        check: RamCheck = job.token
        job.dest.release()
        check.piece_crc32s[job.piece] = job.crc32
        check.error = check.error or error
        check.pieces_left -= 1
        if check.pieces_left == 0:
            self._check_complete(check)

    def _check_complete(self, check: RamCheck) -> None:
        """A scrubbed block's check is in: altered, it is counted, logged and condemned, and its
        next hit reads it again from the pack."""
        self._scrub = None
        slot = check.slot
        slot.checking = False
        assert slot.state is RamState.RESIDENT and slot.key == check.key
        layer = self.layers[check.key.layer]
        found = self._crc_joiner.join(zip(check.piece_crc32s, (n for n in self._crc_bytes[layer.layer] if n)))
        expected = layer.crc32[check.key.expert]
        self.counters.ram_checks += 1
        self.counters.ram_checked_bytes += layer.payload_bytes
        if check.error is None and found == expected:
            return
        self.counters.corrupt_blocks += 1
        self.on_condemned(slot.index)
        why = (f"it cannot be checked ({check.error})" if check.error is not None else
               f"its crc32 is {format_crc32(found)}, the manifest says {format_crc32(expected)}")
        log.error("RAM tier block of layer %d expert %d (slot %d) was altered in memory since it was read: %s. "
                  "A process of expertd's user wrote /dev/shm/%s (only expertd should), or the memory is failing; "
                  "hits since its last check got the altered bytes. It leaves the tier and is read again from "
                  "the pack", check.key.layer, check.key.expert, slot.index, why, self.staging.name)
        self.ram.condemn(slot)

    # ---- reads -------------------------------------------------------------------------------
    def _read(self, work: Work) -> None:
        """Queues the reads of the work's block into its slot (staging or RAM: one segment)."""
        assert work.slot is not None
        layer = self.layers[work.key.layer]
        block = layer.block_offset(work.key.expert)
        pieces = self.pack.splits[layer.layer]
        work.pieces_left = len(pieces)
        work.piece_crc32s = [None] * len(pieces)
        self._reading += 1
        crc_bytes = self._crc_bytes.get(layer.layer) or (0,) * len(pieces)
        for i, (start, length) in enumerate(pieces):
            self.readers.submit(int(work.prio), block + start, self.staging.view(work.slot, start, start + length), work,
                                piece=i, crc_bytes=crc_bytes[i])

    def _on_read_done(self, job: ReadJob, error: BaseException | None, elapsed_ns: int) -> None:
        """Reader thread: hand over to the main loop."""
        self._completions.put((job, error, elapsed_ns))
        os.eventfd_write(self.wake, 1)

    def drain_completions(self) -> None:
        """Main loop: takes in the pieces read since the last call."""
        try:
            os.eventfd_read(self.wake)
        except BlockingIOError:
            pass
        while True:
            try:
                job, error, elapsed_ns = self._completions.get_nowait()
            except queue.Empty:
                return
            if not job.read:
                self._check_piece_done(job, error)
                continue
            nbytes = job.dest.nbytes
            job.dest.release()
            work: Work = job.token
            work.piece_crc32s[job.piece] = job.crc32
            self.read_latency.add_ns(elapsed_ns)
            self.counters.read_ops += 1
            if not self.pack.direct:
                self.counters.fallback_count += 1
            if error is None:
                self.counters.pack_read_bytes += nbytes
                work.session.counters.read_bytes += nbytes
            else:
                work.error = error
                self.counters.io_errors += 1
            work.pieces_left -= 1
            if work.pieces_left == 0:
                self._read_complete(work)

    def in_flight(self) -> bool:
        return (any(s.state is SlotState.READING for s in self.staging.pool.slots)
                or any(s.state is RamState.READING for s in self.ram.slots) or self._scrub is not None)

    def _check(self, work: Work) -> None:
        """Compares the crc32 of the block just read (joined from its pieces') with the manifest's;
        a mismatch becomes the work's error (CorruptBlock), so no byte of the block is served."""
        if work.error is not None or not self.check_crc32:
            return
        layer = self.layers[work.key.layer]
        found = self._crc_joiner.join((crc, n) for crc, n in zip(work.piece_crc32s, self._crc_bytes[layer.layer]) if n)
        self.counters.checked_blocks += 1
        self.counters.checked_bytes += layer.payload_bytes
        expected = layer.crc32[work.key.expert]
        if found != expected:
            work.error = CorruptBlock(layer.block_offset(work.key.expert), layer.payload_bytes, expected, found)

    def _read_failed(self, work: Work) -> tuple[p.FailCode, str]:
        """A read that failed, or whose block is corrupt, counted and logged once (however many keys
        waited on it); the FAIL those keys get."""
        layer, expert = work.key
        if isinstance(work.error, CorruptBlock):
            self.counters.corrupt_blocks += 1
            log.error("corrupt block: layer %d expert %d of %s fails its crc32 check (%s); FAILed CORRUPT, "
                      "never served (run expertpack verify %s; rebuild or restore the pack)",
                      layer, expert, self.pack.path, work.error, self.config.pack)
            return p.FailCode.CORRUPT, (f"layer {layer} expert {expert} of {self.pack.path} is corrupt: {work.error}; "
                                        f"run expertpack verify {self.config.pack}")
        size = os.fstat(self.pack.fd).st_size if isinstance(work.error, ShortRead) else None
        if size is not None and size < self.pack.manifest.pack_size_bytes:
            why = (f"{self.pack.path} is {size:,} bytes now, its manifest says {self.pack.manifest.pack_size_bytes:,}: "
                   f"it was truncated while expertd served it, and layer {layer} expert {expert} lies past its end "
                   f"({work.error}). Restore the pack (expertpack verify {self.config.pack}) and restart expertd")
            log.error("%s", why)
            return p.FailCode.TRUNCATED, why
        log.warning("read of %s failed: %s", list(work.key), work.error)
        return p.FailCode.IO_ERROR, f"read failed: {work.error}"

    def _read_complete(self, work: Work) -> None:
        self._reading -= 1
        if work.ram:
            self._ram_read_complete(work)
            return
        slot = self.staging.pool.slots[work.slot]
        session = work.session
        if not work.cancelled and not session.closed:
            self._check(work)
        if session.closed:  # the client is gone: its slot leaves with it
            slot.move(SlotState.FREE)
            self.staging.pool.give_back(slot.index)
            return
        if work.error is not None or work.cancelled:
            slot.move(SlotState.FREE)
            session.free.append(slot.index)
            if work.cancelled:
                self.finish(work, p.FailCode.CANCELLED, "cancelled")
            else:
                self.finish(work, *self._read_failed(work))
        else:
            slot.move(SlotState.READY)
            slot.move(SlotState.LEASED)
            layer = self.layers[work.key.layer]
            self.fetch_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
            self.finish(work, None, "", p.Ready(work.request_id, work.key, slot.index, layer.payload_bytes))
        self.dispatch(session)

    def _ram_read_complete(self, work: Work) -> None:
        """A read into the RAM tier is in: checked (even if its own client left or cancelled: the
        block is for everyone), then resident and answered to every key waiting on it, or, failed
        or corrupt, dropped and FAILed to them all."""
        slot = self.ram.slot(work.slot)
        self._check(work)
        work.session.ram_reads -= 1
        waiting = self._waiting.pop(slot.index)
        self.ram.filled(slot, work.error is None)
        failure = self._read_failed(work) if work.error is not None else None
        sessions = []
        for w in waiting:
            if w.session.closed or w.done:
                continue
            if w.cancelled:
                self.finish(w, p.FailCode.CANCELLED, "cancelled")
            elif failure is not None:
                self.finish(w, *failure)
            else:
                self._ready_ram(w, slot)
            if w.session not in sessions:
                sessions.append(w.session)
        if work.session not in sessions:
            sessions.append(work.session)
        for session in sessions:
            self.dispatch(session)

    # ---- answers -----------------------------------------------------------------------------
    def _ready_ram(self, work: Work, slot: RamSlot) -> None:
        """READY naming a resident RAM block: the client holds it until it releases it. Never for
        a session that has ended: its holds were all ended with it, and one added now would never be."""
        assert not work.session.closed, "a RAM hold for a session that has ended"
        self.ram.hold(slot)
        work.session.ram_holds[slot.index] += 1
        self.fetch_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
        self.finish(work, None, "", p.Ready(work.request_id, work.key, slot.index, slot.nbytes))

    def finish(self, work: Work, fail: p.FailCode | None, message: str, ready: p.Ready | None = None) -> None:
        """Answers one key exactly once and retires its request when it was the last."""
        work.done = True
        session = work.session
        session.queued -= 1
        if work.ram and ready is None:
            session.ram_taken -= 1  # a FAIL: no hold after all (a READY's ends at its RELEASE)
        if ready is not None:
            self.counters.ready += 1
            session.counters.ready += 1
            session.counters.served_bytes += ready.nbytes
            if work.prio == p.Priority.DEMAND:
                session.counters.demand_latency.add_ns(time.monotonic_ns() - work.submitted_ns)
            self._send(session.identity, ready)
        else:
            self.counters.failed += 1
            session.counters.failed += 1
            self.counters.cancelled += fail is p.FailCode.CANCELLED
            self._send(session.identity, p.Fail(work.request_id, work.key, fail, message[:p.MAX_TEXT]))
        request = session.requests.get(work.request_id)
        if request is not None:
            request.open -= 1
            if request.open == 0:
                del session.requests[work.request_id]

    def close(self) -> None:
        self.readers.stop()
        os.close(self.wake)
