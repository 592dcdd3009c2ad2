"""A block's crc32 joined from its read pieces' crc32s is zlib's crc32 of the whole block, for the
piece lengths a pack's splits give (aligned pieces, a shorter last one, a payload that ends inside
a piece), so the daemon's per-piece check accepts exactly the blocks a whole-block check accepts."""

from __future__ import annotations

import random
import zlib

import pytest

from expertpack.daemon.block_crc import CrcJoiner
from expertpack.daemon.reader import split_ranges


@pytest.mark.parametrize("payload,stride,splits", [
    (110592, 110592, 4),  # the tiny pack's blocks: three pieces of 28672 and one of 24576
    (2654208, 2654208, 4),  # Qwen3-30B-A3B's Q4_K experts
    (1000, 4096, 4),  # a payload inside one aligned piece
    (9000, 12288, 3),  # a payload ending inside the last piece
    (12288, 12288, 1),  # one piece
])
def test_joined_piece_crcs_are_the_blocks_crc(payload: int, stride: int, splits: int) -> None:
    rng = random.Random(payload)
    block = rng.randbytes(payload)
    pieces = [(start, min(length, payload - start)) for start, length in split_ranges(stride, splits)
              if start < payload]
    joiner = CrcJoiner(n for _, n in pieces)
    crcs = [(zlib.crc32(block[start:start + n]), n) for start, n in pieces]
    assert joiner.join(crcs) == zlib.crc32(block)
    flipped = bytearray(block)
    flipped[rng.randrange(payload)] ^= 0x01
    crcs_flipped = [(zlib.crc32(flipped[start:start + n]), n) for start, n in pieces]
    assert joiner.join(crcs_flipped) == zlib.crc32(flipped) != zlib.crc32(block)


def test_a_length_the_joiner_was_not_made_for_is_refused() -> None:
    joiner = CrcJoiner([4096])
    with pytest.raises(KeyError):
        joiner.join([(zlib.crc32(b"a"), 1), (zlib.crc32(b"b"), 1)])
    assert joiner.join([]) == 0
