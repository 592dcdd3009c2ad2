"""The softmax routers (routing.softmax_topk, routing.topk_softmax) and DeepSeek-V4's sqrt-softplus
ones (top-k with a selection bias, or hashed by token id) in one launch per step instead of four to
eight: a program per token holds its router logits, picks the top k one at a time (the largest
left, ties to the lower expert id) and writes ids and weights. float32, the formulas of
routing.py. And the routed experts' lookup in the expert cache's device table (engine.TableDecode)
in one launch instead of three, and the copy of the kept RAM-tier blocks it finds into VRAM: the
GPU reads host memory at PCIe's speed with its own loads (as fast as a DMA copy, measured with
bench/kernel_bandwidth.py --host), where the matvec reading them in place reached 30 GB/s of 50;
and the copy of the next layer's guessed kept blocks ahead of it (expert_ahead), beside the
running layer's kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..nn.ops import AheadSlots


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                         PARTS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr):
    """SOFTMAX_FIRST: softmax over all E, keep the top k (renormalized where NORMALIZE); else the
    top k logits, then a softmax over those k. The logits are the sum of PARTS rows (a router's
    split-K partial sums, added in order)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    x = tl.load(logits_ptr + t * PARTS * E + e, mask=e < E, other=0.0)
    for i in tl.static_range(1, PARTS):
        x += tl.load(logits_ptr + (t * PARTS + i) * E + e, mask=e < E, other=0.0)
    x = tl.where(e < E, x, -float("inf"))
    if SOFTMAX_FIRST:
        p = tl.exp(x - tl.max(x, axis=0))
        x = p / tl.sum(p, axis=0)
    kk = tl.arange(0, KP)  # K padded to a power of two; the padding holds 0 and is not stored
    ids = tl.zeros([KP], tl.int64)
    vals = tl.zeros([KP], tl.float32)
    left = x
    for i in tl.static_range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, BE), axis=0)  # the lowest id among equals
        ids = tl.where(kk == i, pick.to(tl.int64), ids)
        vals = tl.where(kk == i, best, vals)
        left = tl.where(e == pick, -float("inf"), left)
    if SOFTMAX_FIRST:
        if NORMALIZE:
            vals = vals / tl.sum(vals, axis=0)
    else:
        top = tl.where(kk < K, vals, -float("inf"))
        p = tl.exp(top - tl.max(top, axis=0))
        vals = p / tl.sum(p, axis=0)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, vals, mask=kk < K)


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, softmax_first: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (or [T, S, E], S partial sums) -> ids [T, k] int64, weights [T, k] float32."""
    t, e = logits.shape[0], logits.shape[-1]
    parts = logits.shape[1] if logits.dim() == 3 else 1
    x = logits.to(torch.float32).contiguous()
    ids = torch.empty((t, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    _softmax_topk_kernel[(t,)](x, ids, weights, e, K=k, KP=triton.next_power_of_2(k), BE=triton.next_power_of_2(e), PARTS=parts,
                               SOFTMAX_FIRST=softmax_first, NORMALIZE=normalize, num_warps=4)
    return ids, weights


@triton.jit
def _sqrtsoftplus_kernel(logits_ptr, bias_ptr, table_ptr, tokens_ptr, ids_ptr, w_ptr, E, scale, K: tl.constexpr,
                         KP: tl.constexpr, BE: tl.constexpr, HASHED: tl.constexpr):
    """Scores sqrt(softplus(logit)); experts table[token] (HASHED) or the top k of scores + bias;
    weights their scores renormalized, times scale."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    x = tl.load(logits_ptr + t * E + e, mask=e < E, other=0.0)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))  # log1p(y) to float32 precision
    score = tl.sqrt(tl.where(x > 20.0, x, log1p))  # torch's softplus: x itself past its threshold
    kk = tl.arange(0, KP)
    if HASHED:
        token = tl.load(tokens_ptr + t).to(tl.int64)
        ids = tl.load(table_ptr + token * K + kk, mask=kk < K, other=0).to(tl.int64)
        vals = tl.sum(tl.where(e[None, :] == ids[:, None], score[None, :], 0.0), axis=1)
    else:
        ids = tl.zeros([KP], tl.int64)
        vals = tl.zeros([KP], tl.float32)
        left = tl.where(e < E, score + tl.load(bias_ptr + e, mask=e < E, other=0.0), -float("inf"))
        for i in tl.static_range(K):
            best = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == best, e, BE), axis=0)  # the lowest id among equals
            ids = tl.where(kk == i, pick.to(tl.int64), ids)
            vals = tl.where(kk == i, tl.sum(tl.where(e == pick, score, 0.0), axis=0), vals)
            left = tl.where(e == pick, -float("inf"), left)
    vals = tl.where(kk < K, vals, 0.0)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, vals / (tl.sum(vals, axis=0) + 1e-20) * scale, mask=kk < K)


def sqrtsoftplus_route(logits: torch.Tensor, k: int, scale: float, bias: torch.Tensor | None = None,
                       table: torch.Tensor | None = None, tokens: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> ids [T, k] int64, weights [T, k] float32: by the bias [E] (top k), or by
    table [n_vocab, k] at tokens [T] (hashed)."""
    t, e = logits.shape
    x = logits.to(torch.float32).contiguous()
    ids = torch.empty((t, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    hashed = table is not None
    _sqrtsoftplus_kernel[(t,)](x, x if hashed else bias.to(torch.float32).contiguous(),
                               table.contiguous() if hashed else ids, tokens if hashed else ids, ids, weights, e,
                               scale, K=k, KP=triton.next_power_of_2(k), BE=triton.next_power_of_2(e), HASHED=hashed,
                               num_warps=4)
    return ids, weights


@triton.jit
def _expert_lookup_kernel(ids_ptr, row_ptr, rec_ids_ptr, rec_offsets_ptr, offsets_ptr, guess_ptr, counts_ptr, N,
                          E, resident_bytes, slot_bytes, ahead_base, most, BN: tl.constexpr, AHEAD: tl.constexpr):
    """AHEAD: a kept pair whose expert is among the N guessed ones (guess_ptr, whose kept blocks
    _expert_ahead_kernel copies into ahead slots) is read from its ahead slot, and counts_ptr [3]
    gains the kept pairs, those read ahead, and the blocks copied ahead (one program: no atomics)."""
    i = tl.arange(0, BN)
    inside = i < N
    ids = tl.load(ids_ptr + i, mask=inside, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1)
    at = tl.load(row_ptr + ids, mask=inside, other=-1)
    tl.store(rec_ids_ptr + i, ids, mask=inside)
    tl.store(rec_offsets_ptr + i, at, mask=inside)
    transit = resident_bytes + i.to(tl.int64) * slot_bytes
    resident = (at >= 0) & (at < resident_bytes)
    kept = inside & ~resident & (at != -1)
    offsets = tl.where(resident, at, tl.where(at == -1, 0, transit))
    if AHEAD:
        guess = tl.minimum(tl.maximum(tl.load(guess_ptr + i, mask=inside, other=0), 0), E - 1)
        copied = _copied_ahead(guess, row_ptr, inside, resident_bytes, most)
        match = (ids[:, None] == guess[None, :]) & copied[None, :] & kept[:, None]
        found = tl.max(match.to(tl.int32), axis=1) > 0
        g = tl.argmax(match.to(tl.int32), axis=1).to(tl.int64)
        offsets = tl.where(found, ahead_base + g * slot_bytes, offsets)
        c = tl.arange(0, 4)
        add = tl.where(c == 0, tl.sum(kept.to(tl.int64), axis=0),
                       tl.where(c == 1, tl.sum(found.to(tl.int64), axis=0), tl.sum(copied.to(tl.int64), axis=0)))
        tl.store(counts_ptr + c, tl.load(counts_ptr + c, mask=c < 3, other=0) + add, mask=c < 3)
    tl.store(offsets_ptr + i, offsets, mask=inside)


@triton.jit
def _copied_ahead(guess, row_ptr, inside, resident_bytes, most):
    """Which guesses (clamped ids, in the guess's order) _expert_ahead_kernel copies: kept blocks,
    the first `most` of them."""
    at = tl.load(row_ptr + guess, mask=inside, other=-1)
    kept = (inside & (at != -1) & ((at < 0) | (at >= resident_bytes))).to(tl.int32)
    return (kept > 0) & (tl.cumsum(kept, axis=0) - kept < most)


@triton.jit
def _copy_block(pool_ptr, at, dst, nbytes, copy, BLOCK: tl.constexpr):
    """This program's share (every num_programs(0)-th BLOCK) of one block's `nbytes` from `at` to
    `dst` in the pool, where `copy`."""
    at = tl.multiple_of(tl.where(copy, at, 0), 16)
    dst = tl.multiple_of(dst, 16)
    end = tl.cdiv(nbytes, BLOCK) * copy.to(tl.int32)
    o = tl.arange(0, BLOCK).to(tl.int64)
    for chunk in range(tl.program_id(0), end, tl.num_programs(0)):
        at_o = o + chunk * BLOCK
        inside = at_o < nbytes
        tl.store(pool_ptr + dst + at_o, tl.load(pool_ptr + at + at_o, mask=inside), mask=inside)


@triton.jit
def _gather_kept_kernel(pool_ptr, rec_offsets_ptr, offsets_ptr, nbytes, resident_bytes, slot_bytes,
                        BLOCK: tl.constexpr):
    """Program (c, p): pair p's kept block, where the lookup sent it to its transit slot, into that
    slot, every c-th BLOCK of it; nothing for a resident or absent expert, or one copied ahead."""
    p = tl.program_id(1)
    at = tl.load(rec_offsets_ptr + p)
    dst = resident_bytes + p.to(tl.int64) * slot_bytes
    kept = (at != -1) & ((at < 0) | (at >= resident_bytes)) & (tl.load(offsets_ptr + p) == dst)
    _copy_block(pool_ptr, at, dst, nbytes, kept, BLOCK)


@triton.jit
def _expert_ahead_kernel(guess_ptr, row_ptr, pool_ptr, N, E, nbytes, resident_bytes, slot_bytes, ahead_base, most,
                         BN: tl.constexpr, BLOCK: tl.constexpr):
    """Program (c, g): guessed expert g's block, where it is among the first `most` kept in the
    RAM tier, into ahead slot g, every c-th BLOCK of it."""
    g = tl.program_id(1)
    i = tl.arange(0, BN)
    inside = i < N
    guess = tl.minimum(tl.maximum(tl.load(guess_ptr + i, mask=inside, other=0), 0), E - 1)
    copied = _copied_ahead(guess, row_ptr, inside, resident_bytes, most)
    mine = tl.sum(tl.where(i == g, copied.to(tl.int32), 0), axis=0) > 0
    at = tl.load(row_ptr + tl.sum(tl.where(i == g, guess, 0), axis=0))
    _copy_block(pool_ptr, at, ahead_base + g.to(tl.int64) * slot_bytes, nbytes, mine, BLOCK)


GATHER_BLOCK = 4096  # bytes a program copies per turn
GATHER_PROGRAMS = 64  # programs per kept block: enough reads in flight for PCIe's bandwidth (~50 GB/s on the H200)
# Programs per block copied ahead, beside the running layer's kernels: fewer, to leave them the SMs
# (a step's guesses keep a few blocks in flight together).
AHEAD_PROGRAMS = 16


def expert_lookup(ids: torch.Tensor, row: torch.Tensor, rec_ids: torch.Tensor, rec_offsets: torch.Tensor,
                  pool: torch.Tensor, resident_bytes: int, slot_bytes: int, nbytes: int,
                  ahead: AheadSlots | None = None) -> torch.Tensor:
    """TorchOps.expert_lookup's formula: the lookup in one program (a step's pairs are a few dozen
    at most), then the kept blocks not copied ahead copied into their transit slots by
    GATHER_PROGRAMS programs each (one on the CPU, under the interpreter)."""
    n = ids.numel()
    offsets = torch.empty(n, dtype=torch.int64, device=ids.device)
    _expert_lookup_kernel[(1,)](ids.reshape(-1), row, rec_ids, rec_offsets, offsets,
                                offsets if ahead is None else ahead.guess, offsets if ahead is None else ahead.counts,
                                n, row.shape[0], resident_bytes, slot_bytes, 0 if ahead is None else ahead.base,
                                0 if ahead is None else ahead.most, BN=max(16, triton.next_power_of_2(n)),
                                AHEAD=ahead is not None, num_warps=1)
    programs = 1 if pool.device.type == "cpu" else min(GATHER_PROGRAMS, triton.cdiv(nbytes, GATHER_BLOCK))
    _gather_kept_kernel[(programs, n)](pool, rec_offsets, offsets, nbytes, resident_bytes, slot_bytes,
                                       BLOCK=GATHER_BLOCK, num_warps=4)
    return offsets


def expert_ahead(row: torch.Tensor, ahead: AheadSlots, pool: torch.Tensor, resident_bytes: int, slot_bytes: int,
                 nbytes: int) -> None:
    """TorchOps.expert_ahead's formula: AHEAD_PROGRAMS programs a guessed expert (one on the CPU)."""
    guess = ahead.guess
    n = guess.numel()
    programs = 1 if pool.device.type == "cpu" else min(AHEAD_PROGRAMS, triton.cdiv(nbytes, GATHER_BLOCK))
    _expert_ahead_kernel[(programs, n)](guess.reshape(-1), row, pool, n, row.shape[0], nbytes, resident_bytes,
                                        slot_bytes, ahead.base, ahead.most, BN=max(16, triton.next_power_of_2(n)),
                                        BLOCK=GATHER_BLOCK, num_warps=4)
