"""A block's crc32 from the crc32s of the pieces it is read in. Each reader thread checksums its own
piece as soon as it is in, the pieces in parallel;
the main loop then joins them in a few microseconds. Checking the whole block once its last piece
was in had put a serial pass over all of it (about a millisecond for 2.5 MiB) between the disk and
READY, on the path of every key a worker waits for.

zlib's crc32 continued from a value v over n bytes is affine in v, with a linear part that depends
on n alone: crc(A + B) = M_n(crc(A)) ^ crc(B) with n = len(B). M_n is found with zlib itself, from
its image of each of the 32 bits (n zero bytes continued from 1 << i, less the same from 0), once per
piece length a pack has."""

from __future__ import annotations

from typing import Iterable

from expertpack.packtools.layout import block_crc32


class CrcJoiner:
    """The shift operators of the piece lengths of one pack, and the joining of piece crc32s."""

    def __init__(self, lengths: Iterable[int]) -> None:
        self._shift: dict[int, tuple[int, ...]] = {}
        for n in set(lengths):
            zeros = bytes(n)
            base = block_crc32(zeros, 0)
            self._shift[n] = tuple(block_crc32(zeros, 1 << i) ^ base for i in range(32))

    def join(self, pieces: Iterable[tuple[int, int]]) -> int:
        """The crc32 of the pieces' bytes one after another, from (crc32, length) of each in order;
        every length but the first's must be one the joiner was made for."""
        crc = None
        for piece_crc, n in pieces:
            if crc is None:
                crc = piece_crc
                continue
            columns = self._shift[n]
            shifted = 0
            i = 0
            while crc:
                if crc & 1:
                    shifted ^= columns[i]
                crc >>= 1
                i += 1
            crc = shifted ^ piece_crc
        return 0 if crc is None else crc
