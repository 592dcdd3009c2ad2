"""reader.py opens experts.pack fail-closed and does aligned O_DIRECT reads into staging slots from a
pool of threads (os.preadv releases the GIL). It checks the whole contract before the daemon says
it is ready: manifest against pack (size, header, fingerprint), every block offset, every split read
range and length a multiple of 4096. Demand reads overtake prefetch reads in its queue. A read
asked to checksum the payload bytes of its piece does so as soon as they are in (format 1.1; the server
joins the pieces' crc32s and compares the block's with the manifest's, block_crc.py); a job may
also only checksum bytes already in a slot (a RAM tier hit's check), in the same queue and threads.
It knows nothing of sockets or clients: completions go to a callback."""

from __future__ import annotations

import errno
import heapq
import itertools
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from expertpack.packtools.layout import (
    ALIGNMENT, PACK_FILE, LayerLayout, Manifest, PackHeader, block_crc32, format_crc32, manifest_problems,
)

class PackContractError(RuntimeError):
    """The pack cannot be served safely; the message says what is wrong and what to do."""


class ShortRead(OSError):
    """A read that came back short: the pack ends before the range the manifest gave (a regular file
    reads short only at its end), so it was truncated while expertd served it."""

    def __init__(self, offset: int, got: int, wanted: int) -> None:
        super().__init__(errno.EIO, f"short read at byte {offset}: {got} of {wanted} bytes")
        self.offset = offset
        self.got = got
        self.wanted = wanted


class CorruptBlock(Exception):
    """A block read whole whose bytes do not match the crc32 the build recorded for them."""

    def __init__(self, offset: int, nbytes: int, expected: int, found: int) -> None:
        super().__init__(f"the {nbytes} bytes at offset {offset} have crc32 {format_crc32(found)}, the manifest "
                         f"says {format_crc32(expected)}")
        self.offset = offset
        self.nbytes = nbytes
        self.expected = expected
        self.found = found


@dataclass(frozen=True)
class OpenPack:
    manifest: Manifest
    path: Path
    fd: int
    direct: bool
    splits: dict[int, tuple[tuple[int, int], ...]]  # layer -> (offset in block, length) per read piece

    def close(self) -> None:
        os.close(self.fd)


def split_ranges(length: int, pieces: int) -> tuple[tuple[int, int], ...]:
    """[0, length) in at most `pieces` ranges, each a multiple of ALIGNMENT long (length is one)."""
    blocks = length // ALIGNMENT
    per = -(-blocks // pieces)
    out = []
    for start in range(0, blocks, per):
        n = min(per, blocks - start)
        out.append((start * ALIGNMENT, n * ALIGNMENT))
    return tuple(out)


def open_pack(pack_dir: Path, direct_io: bool, read_splits: int) -> OpenPack:
    """Raises PackContractError (or ManifestError) with one clear message on any problem."""
    manifest = Manifest.load(pack_dir)
    problems = manifest_problems(manifest)
    if problems:
        raise PackContractError(f"{pack_dir}: the pack breaks the layout contract: {'; '.join(problems)}")
    path = pack_dir / PACK_FILE
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PackContractError(f"{path}: missing") from None
    if size != manifest.pack_size_bytes:
        raise PackContractError(f"{path}: {size} bytes but the manifest says {manifest.pack_size_bytes}; "
                                "the pack and manifest.json do not belong together (rebuild, or run expertpack verify)")
    flags = os.O_RDONLY | (os.O_DIRECT if direct_io else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if direct_io and exc.errno == errno.EINVAL:
            raise PackContractError(
                f"{path}: this filesystem refuses O_DIRECT (ramfs, some FUSE and network filesystems, tmpfs "
                "before Linux 6.6); put the pack on a local disk, or set direct_io = false to read through "
                "the page cache") from None
        raise PackContractError(f"{path}: cannot open ({exc.strerror})") from None
    try:
        header = PackHeader.decode(_read_header(fd, path, direct_io), path)
        expected = PackHeader.expected_for(manifest)
        if header != expected:
            raise PackContractError(f"{path}: its header {header} does not match manifest.json {expected}")
        splits = {}
        for layer in manifest.layers:
            ranges = split_ranges(layer.stride, read_splits)
            _check_aligned(layer, ranges, manifest.model.n_expert)
            splits[layer.layer] = ranges
    except BaseException:
        os.close(fd)
        raise
    return OpenPack(manifest, path, fd, direct_io, splits)


def _read_header(fd: int, path: Path, direct_io: bool) -> bytes:
    buf = mmap.mmap(-1, ALIGNMENT)  # page-aligned, as O_DIRECT needs
    try:
        n = os.preadv(fd, [buf], 0)
    except OSError as exc:
        if direct_io and exc.errno == errno.EINVAL:
            raise PackContractError(f"{path}: O_DIRECT reads fail here ({exc.strerror}); put the pack on a "
                                    "real disk or set direct_io = false") from None
        raise PackContractError(f"{path}: cannot read the header ({exc.strerror})") from None
    data = bytes(buf[:n])
    buf.close()
    return data


def _check_aligned(layer: LayerLayout, ranges: tuple[tuple[int, int], ...], n_expert: int) -> None:
    for e in (0, n_expert - 1):
        offset = layer.block_offset(e)
        for start, length in ranges:
            if (offset + start) % ALIGNMENT or length % ALIGNMENT:
                raise PackContractError(
                    f"layer {layer.layer} expert {e}: read [{offset + start}, +{length}) is not {ALIGNMENT}-aligned")
    if layer.offset % ALIGNMENT or layer.stride % ALIGNMENT:
        raise PackContractError(f"layer {layer.layer}: offset {layer.offset} / stride {layer.stride} not aligned")


@dataclass(order=True)
class ReadJob:
    prio: int
    seq: int
    offset: int = field(compare=False)  # in experts.pack
    dest: memoryview = field(compare=False)  # the slot bytes to fill
    token: Any = field(compare=False)  # the caller's (the key this piece belongs to)
    piece: int = field(default=0, compare=False)  # which of the token's pieces
    crc_bytes: int = field(default=0, compare=False)  # leading bytes of `dest` to checksum once read (0: none)
    crc32: int | None = field(default=None, compare=False)  # their crc32, set by the reader
    read: bool = field(default=True, compare=False)  # False: `dest` holds its bytes already, only checksum them


Completion = Callable[[ReadJob, "BaseException | None", int], None]  # job, error, elapsed_ns


class ReaderPool:
    """Threads that take jobs (lowest prio first, then FIFO) and preadv them into their slots."""

    def __init__(self, fd: int, threads: int, on_complete: Completion) -> None:
        self._fd = fd
        self._on_complete = on_complete
        self._queue: queue.PriorityQueue[ReadJob] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"reader-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, prio: int, offset: int, dest: memoryview, token: Any, piece: int = 0, crc_bytes: int = 0) -> None:
        """Reads len(dest) bytes at `offset` into `dest`; with `crc_bytes`, the completion's job
        carries the crc32 of dest's first crc_bytes bytes."""
        self._queue.put(ReadJob(prio, next(self._seq), offset, dest, token, piece, crc_bytes))

    def submit_check(self, prio: int, dest: memoryview, token: Any, piece: int = 0) -> None:
        """Checksums the bytes `dest` holds (no read): the completion's job carries their crc32."""
        self._queue.put(ReadJob(prio, next(self._seq), -1, dest, token, piece, len(dest), read=False))

    def promote(self, token: Any, prio: int) -> None:
        """Moves the queued reads of `token` up to `prio`: a demand key that joins a read a prefetch
        started (the RAM tier's one read per key) must not wait behind other prefetches."""
        with self._queue.mutex:  # PriorityQueue's own lock: no reader pops meanwhile
            changed = False
            for job in self._queue.queue:
                if job.token is token and job.prio > prio:
                    job.prio = prio
                    changed = True
            if changed:
                heapq.heapify(self._queue.queue)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job.token is None:  # stop marker
                return
            start = time.monotonic_ns()
            error: BaseException | None = None
            read_ns = 0
            try:
                got = os.preadv(self._fd, [job.dest], job.offset) if job.read else len(job.dest)
                if got != len(job.dest):
                    error = ShortRead(job.offset, got, len(job.dest))
                else:
                    read_ns = time.monotonic_ns() - start  # the read's latency (STATS), without the checksum
                    if job.crc_bytes:  # releases the GIL: the threads checksum in parallel
                        job.crc32 = block_crc32(job.dest[:job.crc_bytes])
                    if not job.read:
                        read_ns = time.monotonic_ns() - start  # a check's latency is its checksum's
            except BaseException as exc:  # any failure fails this read; the thread lives on
                error = exc
            self._on_complete(job, error, read_ns if error is None else time.monotonic_ns() - start)

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(ReadJob(1 << 62, next(self._seq), 0, memoryview(b""), None))
        for t in self._threads:
            t.join()
