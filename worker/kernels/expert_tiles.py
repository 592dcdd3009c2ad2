"""A step's (token, expert) pairs grouped by expert for the kernels that read an expert's bytes once
for several of its pairs (moe_dense's products, moe_tiles' decoding): the pairs sorted by their
block, each distinct expert ranked, and a table of tiles of up to `rows` pairs of one expert, all
built on the device without a host sync. The launches are sized by bounds (the pairs, the blocks
the pool can hold) and a kernel program whose tile is unused returns at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..weights.expert_roles import ExpertRoles


@dataclass
class ExpertTiles:
    order: torch.Tensor  # [P] int32: sorted row -> its pair
    tokens: torch.Tensor  # [P] int32: sorted row -> its token
    blocks: torch.Tensor  # [max_experts + 1] int64: rank -> block offset in the pool (the last a sink)
    n_experts: torch.Tensor  # [1]: the step's distinct experts
    table: torch.Tensor  # [max_tiles, 3] int32: (rank, first row, end row); unused tiles (0, 0, 0)
    max_experts: int


def block_extent(roles: ExpertRoles) -> int:
    """Bytes of a block its matrices reach: blocks do not overlap, so a pool of B bytes holds at
    most B // extent distinct experts."""
    return max(r.offset + r.n * r.row_bytes for r in (roles.gate, roles.up, roles.down))


def expert_tiles(offsets: torch.Tensor, pairs: torch.Tensor | None, k_top: int, pool_bytes: int,
                 roles: ExpertRoles, rows: int, n_expert: int | None = None) -> ExpertTiles:
    """The pairs to run (all, or `pairs`), sorted by block, in tiles of at most `rows` pairs.
    `n_expert`, the layer's routed experts where known, bounds the distinct experts best: a
    cache's pool holds every layer's slots."""
    dev = offsets.device
    idx = pairs.to(torch.int64) if pairs is not None else torch.arange(offsets.shape[0], device=dev)
    sorted_blocks, perm = torch.sort(offsets[idx], stable=True)
    order = idx[perm].to(torch.int32).contiguous()
    max_experts = min(idx.shape[0], pool_bytes // block_extent(roles), n_expert or idx.shape[0])
    blocks, n_experts, table = tile_table(sorted_blocks, max_experts, rows)
    return ExpertTiles(order, (order // k_top).contiguous(), blocks, n_experts, table, max_experts)


SCAN_MAX_PAIRS = 8192  # up to this many pairs, the table is one launch (one program scans them all)


def tile_table(sorted_blocks: torch.Tensor, max_experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the pairs' blocks in sorted order: each distinct expert's block by rank ([max_experts +
    1], the last entry a sink), their number [1], and the tile table [ceil(P/rows) + max_experts, 3]
    int32 of (rank, first row, end row), a tile holding up to `rows` rows of one expert. A prompt's
    pairs take one kernel (a prompt is launched from Python, so the two dozen small torch
    operations of tile_table_ops would cost more than its experts' work at tens of tokens)."""
    p = sorted_blocks.shape[0]
    if p > SCAN_MAX_PAIRS:
        return tile_table_ops(sorted_blocks, max_experts, rows)
    dev = sorted_blocks.device
    max_tiles = triton.cdiv(p, rows) + max_experts
    blocks = torch.zeros(max_experts + 1, dtype=torch.int64, device=dev)
    start = torch.empty(max_experts + 1, dtype=torch.int64, device=dev)
    n_experts = torch.empty(1, dtype=torch.int64, device=dev)
    table = torch.zeros((max_tiles, 3), dtype=torch.int32, device=dev)
    _tile_table_kernel[(1,)](sorted_blocks.contiguous(), blocks, start, n_experts, table, p,
                             ROWS=rows, BP=triton.next_power_of_2(p), num_warps=8)
    return blocks, n_experts, table


@triton.jit
def _tile_table_kernel(sorted_ptr, blocks_ptr, start_ptr, n_ptr, table_ptr, P, ROWS: tl.constexpr, BP: tl.constexpr):
    """tile_table in one program over all P rows: a new expert where the block changes, its rank
    the running count of those, its block and first row stored by rank; then, with the ranks'
    first rows read back, the rows that start a tile of ROWS write its (rank, first, end) entry."""
    i = tl.arange(0, BP)
    valid = i < P
    b = tl.load(sorted_ptr + i, mask=valid, other=0)
    before = tl.load(sorted_ptr + i - 1, mask=valid & (i > 0), other=0)
    new = valid & ((i == 0) | (b != before))
    rank = tl.cumsum(new.to(tl.int32), 0) - 1
    tl.store(blocks_ptr + rank, b, mask=new)
    tl.store(start_ptr + rank, i.to(tl.int64), mask=new)
    n = tl.max(tl.where(valid, rank, -1), 0) + 1
    tl.debug_barrier()  # every rank's first row stored before any is read
    first = tl.load(start_ptr + rank, mask=valid, other=0).to(tl.int32)
    end = tl.load(start_ptr + rank + 1, mask=valid & (rank + 1 < n), other=P).to(tl.int32)  # the next expert's first
    opens = valid & ((i - first) % ROWS == 0)
    tile = tl.cumsum(opens.to(tl.int32), 0) - 1
    tl.store(table_ptr + 3 * tile, rank, mask=opens)
    tl.store(table_ptr + 3 * tile + 1, i, mask=opens)
    tl.store(table_ptr + 3 * tile + 2, tl.minimum(i + ROWS, end), mask=opens)
    tl.store(n_ptr, n.to(tl.int64))


def tile_table_ops(sorted_blocks: torch.Tensor, max_experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tile_table in torch operations, for more pairs than one program scans."""
    p = sorted_blocks.shape[0]
    dev = sorted_blocks.device
    row = torch.arange(p, device=dev)
    new = torch.ones(p, dtype=torch.bool, device=dev)
    new[1:] = sorted_blocks[1:] != sorted_blocks[:-1]
    rank = torch.cumsum(new, 0) - 1
    sink = torch.where(new, rank, max_experts)
    blocks = torch.zeros(max_experts + 1, dtype=torch.int64, device=dev).index_put_((sink,), sorted_blocks)
    start = torch.zeros(max_experts + 1, dtype=torch.int64, device=dev).index_put_((sink,), row)
    count = torch.zeros(max_experts, dtype=torch.int64, device=dev).index_add_(0, rank, torch.ones_like(rank))
    is_first = (row - start[rank]) % rows == 0  # the row starts a tile of its expert
    max_tiles = triton.cdiv(p, rows) + max_experts
    tile = torch.where(is_first, torch.cumsum(is_first, 0) - 1, max_tiles)
    entry = torch.stack([rank, row, torch.minimum(row + rows, start[rank] + count[rank])], dim=1)
    table = torch.zeros((max_tiles + 1, 3), dtype=torch.int64, device=dev).index_put_((tile,), entry)
    return blocks, rank[-1:] + 1, table[:max_tiles].to(torch.int32).contiguous()


@triton.jit
def tile_at(table_ptr, t, first, experts, ROWS: tl.constexpr):
    """Tile t of the table: its expert's rank, that rank's place among ranks first ..
    first+experts-1 (a group's scratch), its rows and their mask, and whether the tile is not this
    launch's (unused, or of an expert outside those ranks)."""
    rank = tl.load(table_ptr + 3 * t)
    r0 = tl.load(table_ptr + 3 * t + 1)
    r1 = tl.load(table_ptr + 3 * t + 2)
    r = r0 + tl.arange(0, ROWS)
    elsewhere = (rank < first) | (rank >= first + experts) | (r1 <= r0)
    return rank, rank - first, r, r < r1, elsewhere
