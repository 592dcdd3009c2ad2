"""DeepSeek-V4's compressor for one decode token (compressed_attention._compress_step) in two
launches where torch takes about 27 a compressor (three a CSA layer and one an HCA layer hold one or
two): the token's projections join their window, the window is pooled (a softmax over its rows per
channel, CSA's over the previous window's first series too), normalized, roped at the window's
start and written as an entry only where the window completes, which also moves CSA's overlap on
and clears the window's rows. torch's softmax over the rows of HCA's [128, 512] window is a slow
strided kernel besides. float32, the formulas of compressed_attention.py (sums in another order).
Also the mask of the keys a decode token sees, in one launch where torch takes about ten."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POOL_CHANNELS = 32  # channels of the entry per program of the pooling launch


@triton.jit
def _window(kv_ptr, gate_ptr, new_kv_ptr, new_gate_ptr, ape_ptr, r, column, cm, m2, mine, W):
    """The window's kv and gate + ape in `column` [BR, BC], the token's row (`mine`) in place."""
    kv = tl.load(kv_ptr + r[:, None] * W + column[None, :], mask=m2, other=0.0)
    gate = tl.load(gate_ptr + r[:, None] * W + column[None, :], mask=m2, other=0.0)
    kv = tl.where(mine, tl.load(new_kv_ptr + column, mask=cm, other=0.0)[None, :], kv)
    gate = tl.where(mine, tl.load(new_gate_ptr + column, mask=cm, other=0.0)[None, :], gate)
    return kv, gate + tl.load(ape_ptr + r[:, None] * W + column[None, :], mask=m2, other=0.0)


@triton.jit
def _pool_kernel(kv_ptr, gate_ptr, new_kv_ptr, new_gate_ptr, ape_ptr, okv_ptr, ogate_ptr, pooled_ptr, pos_ptr,
                 W, D, RATIO: tl.constexpr, OVERLAP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """grid (cdiv(D, BC),): entry channels j. The window's rows [RATIO, W] with the token's row at
    its offset (written back), gates plus ape; pooled over the rows of column j (HCA) or of column
    D + j after the overlap's rows of column j (CSA), whose first series (column j) becomes the
    overlap where the window completes."""
    j = tl.program_id(0) * BC + tl.arange(0, BC)
    r = tl.arange(0, BR)
    offset = tl.load(pos_ptr) % RATIO
    complete = offset == RATIO - 1
    rows = r[:, None] < RATIO
    cols = j[None, :] < D
    m2 = rows & cols
    mine = r[:, None] == offset
    col = j + D if OVERLAP else j  # the pooled series' column

    kv, gate = _window(kv_ptr, gate_ptr, new_kv_ptr, new_gate_ptr, ape_ptr, r, col, j < D, m2, mine, W)
    gate = tl.where(m2, gate, float("-inf"))
    top = tl.max(gate, axis=0)
    if OVERLAP:
        okv = tl.load(okv_ptr + r[:, None] * D + j[None, :], mask=m2, other=0.0)
        ogate = tl.load(ogate_ptr + r[:, None] * D + j[None, :], mask=m2, other=float("-inf"))
        top = tl.maximum(top, tl.max(ogate, axis=0))
    top = tl.where(j < D, top, 0.0)  # columns past D: finite (their sums are never stored)
    e = tl.exp(gate - top[None, :])
    total = tl.sum(e, axis=0)
    if OVERLAP:
        oe = tl.exp(ogate - top[None, :])
        total += tl.sum(oe, axis=0)
    total = tl.where(j < D, total, 1.0)
    pooled = tl.sum(kv * (e / total[None, :]), axis=0)
    if OVERLAP:
        pooled += tl.sum(okv * (oe / total[None, :]), axis=0)
    tl.store(pooled_ptr + j, pooled, mask=j < D)
    tl.store(kv_ptr + offset * W + col, tl.load(new_kv_ptr + col, mask=j < D), mask=j < D)
    tl.store(gate_ptr + offset * W + col, tl.load(new_gate_ptr + col, mask=j < D), mask=j < D)
    if OVERLAP:
        first_kv, first_gate = _window(kv_ptr, gate_ptr, new_kv_ptr, new_gate_ptr, ape_ptr, r, j, j < D, m2,
                                        mine, W)
        tl.store(kv_ptr + offset * W + j, tl.load(new_kv_ptr + j, mask=j < D), mask=j < D)
        tl.store(gate_ptr + offset * W + j, tl.load(new_gate_ptr + j, mask=j < D), mask=j < D)
        tl.debug_barrier()  # every thread read the old overlap above
        tl.store(okv_ptr + r[:, None] * D + j[None, :], first_kv, mask=m2 & complete)
        tl.store(ogate_ptr + r[:, None] * D + j[None, :], first_gate, mask=m2 & complete)


@triton.jit
def _entry_kernel(pooled_ptr, norm_ptr, cos_ptr, sin_ptr, entries_ptr, kv_ptr, gate_ptr, pos_ptr, W, D, eps,
                  RATIO: tl.constexpr, ROT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr):
    """grid (RATIO,): where the window completes, program 0 writes its entry (normalized, its last
    ROT channels roped in adjacent pairs at the window's first position) and program r clears the
    window's row r."""
    pos = tl.load(pos_ptr)
    if pos % RATIO == RATIO - 1:
        r = tl.program_id(0)
        if r == 0:
            window = pos // RATIO
            i = tl.arange(0, BD)
            x = tl.load(pooled_ptr + i, mask=i < D, other=0.0)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            rot = (i >= D - ROT) & (i < D)
            k = i - (D - ROT)  # index within the roped tail
            partner = (D - ROT) + (k ^ 1)
            y = x * inv * tl.load(norm_ptr + i, mask=i < D, other=0.0)
            other = (tl.load(pooled_ptr + partner, mask=rot, other=0.0) * inv
                     * tl.load(norm_ptr + partner, mask=rot, other=0.0))
            c = tl.load(cos_ptr + window * RATIO * (ROT // 2) + k // 2, mask=rot, other=1.0)
            s = tl.load(sin_ptr + window * RATIO * (ROT // 2) + k // 2, mask=rot, other=0.0)
            y = tl.where(rot, y * c + tl.where(k % 2 == 0, -1.0, 1.0) * other * s, y)
            tl.store(entries_ptr + window * D + i, y, mask=i < D)
        w = tl.arange(0, BW)
        tl.store(kv_ptr + r * W + w, tl.zeros([BW], tl.float32), mask=w < W)
        tl.store(gate_ptr + r * W + w, tl.zeros([BW], tl.float32), mask=w < W)


def compress_step(kv: torch.Tensor, gate: torch.Tensor, overlap: tuple[torch.Tensor, torch.Tensor] | None,
                  entries: torch.Tensor, new_kv: torch.Tensor, new_gate: torch.Tensor, ape: torch.Tensor,
                  norm: torch.Tensor, eps: float, position: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rot: int) -> None:
    """One token at the device `position` [1] into a compressor's buffers, in place: kv, gate
    [ratio, W] (W = d, or 2 * d with the overlap [ratio, d] pair), entries [n, d]. new_kv, new_gate
    [1, W] its projections, ape [ratio, W], norm [d]; cos/sin [N, rot/2] the rope tables by
    position (adjacent pairs), N past the window's first position."""
    ratio, width = kv.shape
    d = norm.shape[0]
    pooled = torch.empty(d, dtype=torch.float32, device=kv.device)
    okv, ogate = overlap if overlap is not None else (kv, kv)
    _pool_kernel[(triton.cdiv(d, POOL_CHANNELS),)](
        kv, gate, new_kv.contiguous(), new_gate.contiguous(), ape.contiguous(), okv, ogate, pooled, position,
        width, d, RATIO=ratio, OVERLAP=overlap is not None, BR=triton.next_power_of_2(ratio), BC=POOL_CHANNELS,
        num_warps=4)
    _entry_kernel[(ratio,)](pooled, norm.contiguous(), cos, sin, entries, kv, gate, position, width, d, eps,
                            RATIO=ratio, ROT=rot, BD=triton.next_power_of_2(d), BW=triton.next_power_of_2(width),
                            num_warps=4)


VISIBLE_BLOCK = 1024


@triton.jit
def _visible_kernel(pos_ptr, out_ptr, SIZE, N, RATIO, BLOCK: tl.constexpr):
    """grid (cdiv(SIZE + 1 + N, BLOCK),): key j < SIZE a raw ring row (held once the token's
    position passed it), j == SIZE the token's own, then N entries (seen once their window is
    complete)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr)
    seen = tl.where(j < SIZE, j < pos, (j == SIZE) | (j - SIZE - 1 < (pos + 1) // RATIO))
    tl.store(out_ptr + j, seen.to(tl.int8), mask=j < SIZE + 1 + N)


def step_visible(position: torch.Tensor, size: int, n_entries: int, ratio: int) -> torch.Tensor:
    """[1, size + 1 + n_entries] bool: the keys (the ring of `size` raw entries, the token's own,
    the compressed entries) a token at the device `position` [1] sees (ratio 0: no entries)."""
    width = size + 1 + n_entries
    out = torch.empty((1, width), dtype=torch.bool, device=position.device)
    _visible_kernel[(triton.cdiv(width, VISIBLE_BLOCK),)](position, out.view(torch.int8), size, n_entries,
                                                          max(ratio, 1), BLOCK=VISIBLE_BLOCK, num_warps=4)
    return out
