"""The hot path of a build: one sequential read of each source shard (a read-ahead thread keeps the
disk busy while the main thread hashes and writes), routing every tensor's bytes to where they
belong: trunk tensors to their place in trunk.gguf, each expert's slice of a stacked expert tensor to
its role's place in that expert's block of experts.pack. It knows nothing of manifests or resume
state; it reports finished segments through a callback."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

CHUNK_BYTES = 16 << 20
READ_AHEAD = 3  # buffers in flight: one being consumed, two being filled


@dataclass(frozen=True, slots=True)
class TrunkSegment:
    """A trunk tensor: copied whole to `dest` in trunk.gguf."""

    offset: int
    nbytes: int
    name: str
    dest: int

    def write(self, fds: "OutputFds", data: memoryview, rel: int) -> None:
        _pwrite_all(fds.trunk, data, self.dest + rel)


@dataclass(frozen=True, slots=True)
class ExpertSegment:
    """A stacked expert tensor: expert e's slice goes to block e of its layer, at the role's offset."""

    offset: int
    nbytes: int
    name: str
    layer: int
    block_start: int  # absolute offset of expert 0's block
    stride: int
    role_offset: int
    bytes_per_expert: int

    def write(self, fds: "OutputFds", data: memoryview, rel: int) -> None:
        done = 0
        while done < len(data):
            expert, within = divmod(rel + done, self.bytes_per_expert)
            n = min(self.bytes_per_expert - within, len(data) - done)
            dest = self.block_start + expert * self.stride + self.role_offset + within
            _pwrite_all(fds.pack, data[done:done + n], dest)
            done += n


Segment = TrunkSegment | ExpertSegment


@dataclass(frozen=True, slots=True)
class OutputFds:
    pack: int
    trunk: int


def copy_shard(
    fd: int,
    size_bytes: int,
    start: int,
    segments: list[Segment],
    fds: OutputFds,
    digest: "hashlib._Hash",
    on_bytes: Callable[[int], None],
    on_segment_done: Callable[[Segment, str | None], None],
) -> None:
    """Streams shard bytes [start, size_bytes) through `digest` and routes segment bytes to the
    outputs. `segments` are sorted, disjoint, and none straddles `start`. `on_segment_done` gets a
    trunk segment's sha256 (None for expert segments, whose blocks are hashed once complete)."""
    pending = [s for s in segments if s.offset >= start]
    index = 0
    trunk_digest = None
    for chunk_offset, view in read_chunks(fd, start, size_bytes):
        digest.update(view)
        chunk_end = chunk_offset + len(view)
        while index < len(pending) and pending[index].offset < chunk_end:
            seg = pending[index]
            lo = max(seg.offset, chunk_offset)
            hi = min(seg.offset + seg.nbytes, chunk_end)
            if lo < hi:
                part = view[lo - chunk_offset:hi - chunk_offset]
                seg.write(fds, part, lo - seg.offset)
                if isinstance(seg, TrunkSegment):
                    trunk_digest = trunk_digest or hashlib.sha256()
                    trunk_digest.update(part)
            if seg.offset + seg.nbytes > chunk_end:
                break
            if isinstance(seg, TrunkSegment):
                on_segment_done(seg, (trunk_digest or hashlib.sha256()).hexdigest())
                trunk_digest = None
            else:
                on_segment_done(seg, None)
            index += 1
        on_bytes(len(view))
    if index != len(pending):
        raise OSError(f"source ended before tensor {pending[index].name} was complete")


def hash_prefix(fd: int, end: int, digest: "hashlib._Hash", on_bytes: Callable[[int], None]) -> None:
    """Feeds bytes [0, end) to `digest`: how a resumed build recovers the source digest."""
    for _, view in read_chunks(fd, 0, end):
        digest.update(view)
        on_bytes(len(view))


def read_chunks(fd: int, start: int, end: int) -> Iterator[tuple[int, memoryview]]:
    """Yields (offset, bytes) over [start, end) in order. A background thread reads ahead into a
    small ring of buffers; a yielded view is valid until the next iteration."""
    if start >= end:
        return
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(READ_AHEAD):
        free.put(bytearray(min(CHUNK_BYTES, end - start)))
    filled: queue.Queue[tuple[int, bytearray, int] | BaseException] = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            offset = start
            while offset < end and not stop.is_set():
                buf = free.get()
                if stop.is_set():
                    return
                want = min(len(buf), end - offset)
                got = os.preadv(fd, [memoryview(buf)[:want]], offset)
                if got != want:
                    raise OSError(f"short read at byte {offset}: wanted {want}, got {got} (file truncated?)")
                filled.put((offset, buf, want))
                offset += want
        except BaseException as exc:  # handed to the consumer, which raises it
            filled.put(exc)

    thread = threading.Thread(target=reader, name="source-read", daemon=True)
    thread.start()
    try:
        received = start
        while received < end:
            item = filled.get()
            if isinstance(item, BaseException):
                raise item
            offset, buf, n = item
            yield offset, memoryview(buf)[:n]
            free.put(buf)
            received += n
    finally:
        stop.set()
        free.put(bytearray(0))  # wakes a reader blocked on an empty free list
        thread.join()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
