"""sha256 of expert blocks read back from experts.pack, in parallel: os.pread and hashlib both
release the GIL, so threads use every core. Memory is bounded by threads x one block."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .layout import ExpertKey, LayerLayout

READ_PIECE_BYTES = 8 << 20  # hash a large block in pieces so a thread never holds more than this


def read_range(fd: int, offset: int, nbytes: int, digest: Any) -> None:
    """Feeds bytes [offset, offset + nbytes) of an open file to digest.update, in pieces; a short
    read is an error."""
    done = 0
    while done < nbytes:
        want = min(READ_PIECE_BYTES, nbytes - done)
        piece = os.pread(fd, want, offset + done)
        if len(piece) != want:
            raise OSError(f"short read at byte {offset + done}: wanted {want}, got {len(piece)} (file truncated?)")
        digest.update(piece)
        done += want


def hash_range(fd: int, offset: int, nbytes: int) -> str:
    """sha256 of bytes [offset, offset + nbytes) of an open file."""
    digest = hashlib.sha256()
    read_range(fd, offset, nbytes, digest)
    return digest.hexdigest()


class BlockHasher:
    """Hashes whole layers of expert blocks on a thread pool; results arrive through `on_done`
    (called on a pool thread) so the caller can record them as they complete."""

    def __init__(self, fd: int, threads: int, on_done: Callable[[ExpertKey, str], None]) -> None:
        self._fd = fd
        self._on_done = on_done
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hash")
        self._futures: list[Future[None]] = []

    def submit_layer(self, layer: LayerLayout, n_expert: int) -> None:
        for expert in range(n_expert):
            self._futures.append(self._pool.submit(self._hash_one, layer, expert))

    def _hash_one(self, layer: LayerLayout, expert: int) -> None:
        digest = hash_range(self._fd, layer.block_offset(expert), layer.payload_bytes)
        self._on_done(ExpertKey(layer.layer, expert), digest)

    def wait(self) -> None:
        """Blocks until every submitted block is hashed; re-raises the first failure."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
