"""The hot path of a build: one sequential read of each source shard, routing every tensor's bytes
to where they belong: trunk tensors to their place in trunk.gguf, each expert's slice of a stacked
expert tensor to its role's place in that expert's block of experts.pack.

I/O bypasses the page cache where the filesystem allows (O_DIRECT): on the machines measured the
kernel's copies into and out of the page cache cost more CPU than the two sha256 passes a build
must make. A read-ahead thread reads page-aligned chunks and feeds the source digest; the consumer
gathers each expert slice into an aligned buffer and writes it with one O_DIRECT pwrite (roles sit
at 4096-aligned offsets; the bytes up to the next 4096 boundary are the block's zero padding), and
for layers streamed from their first role feeds each block's sha256 as the bytes pass (roles sit in
the block in stream order, so no read-back). It knows nothing of manifests or resume state; it
reports finished segments through a callback.

Shard bytes come from a ShardReader: a file (FileReader), or bytes made as they are read (synth's
stream.py, which packs a synthetic model without its GGUF ever being written); the pass cannot tell
them apart."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from .layout import ALIGNMENT as DIRECT  # O_DIRECT granularity: offsets, lengths, buffer addresses
from .units import round_up as _round_up

CHUNK_BYTES = 16 << 20
READ_AHEAD = 4  # source buffers in flight between the reader, the digest and the consumer
SLICE_BUFFERS = 3  # expert slices in flight between the consumer and the pack writer
ZEROS = bytes(DIRECT)


def round_up(n: int) -> int:
    return _round_up(n, DIRECT)


@dataclass(frozen=True, slots=True)
class OutputFds:
    pack: int  # O_DIRECT when `pack_direct`
    trunk: int
    pack_direct: bool


@dataclass(frozen=True, slots=True)
class TrunkSegment:
    """A trunk tensor: copied whole to `dest` in trunk.gguf."""

    offset: int
    nbytes: int
    name: str
    dest: int


@dataclass(frozen=True, slots=True)
class ExpertSegment:
    """A stacked expert tensor: expert e's slice goes to block e of its layer, at the role's offset.
    `pad_before` zero bytes separate it from the previous role in the block (they are hashed too)."""

    offset: int
    nbytes: int
    name: str
    layer: int
    block_start: int  # absolute offset of expert 0's block
    stride: int
    role_offset: int
    bytes_per_expert: int
    pad_before: int

    def dest(self, expert: int) -> int:
        return self.block_start + expert * self.stride + self.role_offset


Segment = TrunkSegment | ExpertSegment


class ShardReader(Protocol):
    """One source shard's bytes. read_into is called from one thread at a time, at increasing
    offsets; whoever opened the reader closes it."""

    name: str  # what error messages call the shard (its path)
    alignment: int  # a read starts at a multiple of this (O_DIRECT's block for a file; 1 for made bytes)

    def read_into(self, buf: memoryview, at: int, want: int) -> int:
        """Reads bytes [at, at + want) into buf[:want] (buf may be longer: an O_DIRECT read fills
        whole blocks); returns how many it read, fewer only at the end of the shard."""
        ...

    def close(self) -> None:
        ...


class FileReader:
    """A shard on disk, read with O_DIRECT where the filesystem takes it."""

    alignment = DIRECT  # a file is read from block boundaries with or without O_DIRECT, as it always was

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.fd, self.direct = open_direct(path, os.O_RDONLY)

    def read_into(self, buf: memoryview, at: int, want: int) -> int:
        return os.preadv(self.fd, [buf[:round_up(want) if self.direct else want]], at)

    def close(self) -> None:
        os.close(self.fd)


class SliceWriter:
    """Gathers one expert slice at a time into a page-aligned buffer and hands it, padded with zeros
    to the next 4096 boundary, to a writer thread: every pack write is one aligned O_DIRECT write,
    and it overlaps the hashing of the next slice. `flush` waits for every write handed off."""

    def __init__(self, max_slice_bytes: int, fds: OutputFds) -> None:
        self.fds = fds
        size = max(DIRECT, round_up(max_slice_bytes))
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(SLICE_BUFFERS):
            self._free.put(memoryview(mmap.mmap(-1, size)))
        self._todo: queue.Queue[tuple[memoryview, int, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pack-write", daemon=True)
        self._thread.start()
        self._buf = self._free.get()

    def feed(self, seg: ExpertSegment, data: memoryview, rel: int, hashers: list | None) -> None:
        """`data` is bytes [rel, rel + len(data)) of the segment, the next after the previous call."""
        bpe = seg.bytes_per_expert
        done = 0
        while done < len(data):
            expert, within = divmod(rel + done, bpe)
            n = min(bpe - within, len(data) - done)
            piece = data[done:done + n]
            if within == 0:
                self._buf[bpe:round_up(bpe)] = ZEROS[:round_up(bpe) - bpe]
                if hashers is not None and seg.pad_before:
                    hashers[expert].update(ZEROS[:seg.pad_before])
            self._buf[within:within + n] = piece
            if hashers is not None:
                hashers[expert].update(piece)
            if within + n == bpe:
                self._todo.put((self._buf, round_up(bpe) if self.fds.pack_direct else bpe, seg.dest(expert)))
                self._buf = self._free.get()
                self._raise_if_failed()
            done += n

    def flush(self) -> None:
        self._todo.join()
        self._raise_if_failed()

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            buf, length, dest = item
            try:
                if self._error is None:
                    _pwrite_all(self.fds.pack, buf[:length], dest)
            except BaseException as exc:  # raised in the feeding thread
                self._error = exc
            finally:
                self._free.put(buf)
                self._todo.task_done()
        self._todo.task_done()


def copy_shard(
    source: ShardReader,
    size_bytes: int,
    start: int,
    segments: list[Segment],
    fds: OutputFds,
    digest: "hashlib._Hash",
    block_hashers: dict[int, list],
    on_bytes: Callable[[int], None],
    on_segment_done: Callable[[Segment, str | None], None],
) -> None:
    """Streams shard bytes [start, size_bytes) from `source` through `digest` and routes segment
    bytes to the outputs. `segments` are sorted, disjoint, and none straddles `start`. Expert bytes of a layer in
    `block_hashers` feed its per-expert sha256 objects. `on_segment_done` gets a trunk segment's
    sha256 (None for expert segments)."""
    pending = [s for s in segments if s.offset >= start]
    writer = SliceWriter(max((s.bytes_per_expert for s in pending if isinstance(s, ExpertSegment)), default=0), fds)
    index = 0
    trunk_digest = hashlib.sha256()
    try:
        for chunk_offset, view in read_chunks(source, start, size_bytes, digest):
            chunk_end = chunk_offset + len(view)
            while index < len(pending) and pending[index].offset < chunk_end:
                seg = pending[index]
                lo = max(seg.offset, chunk_offset)
                hi = min(seg.offset + seg.nbytes, chunk_end)
                if lo < hi:
                    part = view[lo - chunk_offset:hi - chunk_offset]
                    if isinstance(seg, TrunkSegment):
                        _pwrite_all(fds.trunk, part, seg.dest + lo - seg.offset)
                        trunk_digest.update(part)
                    else:
                        writer.feed(seg, part, lo - seg.offset, block_hashers.get(seg.layer))
                if seg.offset + seg.nbytes > chunk_end:
                    break
                if isinstance(seg, TrunkSegment):
                    on_segment_done(seg, trunk_digest.hexdigest())
                    trunk_digest = hashlib.sha256()
                else:
                    writer.flush()  # the segment's bytes are in the file before anyone records it done
                    on_segment_done(seg, None)
                index += 1
            on_bytes(len(view))
    finally:
        writer.close()
    if index != len(pending):
        raise OSError(f"{source.name}: ended before tensor {pending[index].name} was complete")


def hash_prefix(source: ShardReader, end: int, digest: "hashlib._Hash", on_bytes: Callable[[int], None]) -> None:
    """Feeds bytes [0, end) to `digest`: how a resumed build recovers the source digest."""
    for _, view in read_chunks(source, 0, end, digest):
        on_bytes(len(view))


def read_chunks(source: ShardReader, start: int, end: int,
                digest: "hashlib._Hash") -> Iterator[tuple[int, memoryview]]:
    """Yields (offset, bytes) covering [start, end) in order, through a three-stage pipeline over a
    small ring of page-aligned buffers: a reader thread calling `source`, a digest thread feeding
    `digest`, and the caller. A yielded view is valid until the next iteration."""
    if start >= end:
        return
    free: queue.Queue[mmap.mmap] = queue.Queue()
    for _ in range(READ_AHEAD):
        free.put(mmap.mmap(-1, CHUNK_BYTES))
    read: queue.Queue[tuple[int, mmap.mmap, int, int] | BaseException | None] = queue.Queue()
    hashed: queue.Queue[tuple[int, mmap.mmap, int, int] | BaseException] = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            at = start - start % source.alignment  # O_DIRECT reads start on a block boundary
            while at < end and not stop.is_set():
                buf = free.get()
                if stop.is_set():
                    return
                want = min(CHUNK_BYTES, end - at)
                got = source.read_into(memoryview(buf), at, want)
                if got < want:
                    raise OSError(f"{source.name}: short read at byte {at}: wanted {want}, got {got} "
                                  "(file truncated?)")
                skip = max(0, start - at)
                read.put((at + skip, buf, skip, want))
                at += want
        except BaseException as exc:  # handed down the pipeline to the caller, which raises it
            read.put(exc)
        finally:
            read.put(None)

    def hasher() -> None:
        while (item := read.get()) is not None:
            if not isinstance(item, BaseException):
                _, buf, lo, hi = item
                digest.update(memoryview(buf)[lo:hi])
            hashed.put(item)

    threads = [threading.Thread(target=reader, name="source-read", daemon=True),
               threading.Thread(target=hasher, name="source-digest", daemon=True)]
    for t in threads:
        t.start()
    try:
        received = start
        while received < end:
            item = hashed.get()
            if isinstance(item, BaseException):
                raise item
            offset, buf, lo, hi = item
            yield offset, memoryview(buf)[lo:hi]
            free.put(buf)
            received = offset + (hi - lo)
    finally:
        stop.set()
        free.put(mmap.mmap(-1, DIRECT))  # wakes a reader blocked on an empty free list
        for t in threads:
            t.join()


def open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Opens with O_DIRECT, or without it where the filesystem refuses (ramfs, some FUSE mounts)."""
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags), False


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
