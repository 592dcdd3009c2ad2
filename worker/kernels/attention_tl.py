"""Attention of a few query tokens (a decode step) over a KV buffer, in two launches instead of the
fifteen-odd torch ops of layers.attention (repeat_interleave copies, two einsums, a mask built from
aranges, masked_fill, softmax). Flash-decoding: the keys a query may see are cut into blocks, the
blocks dealt round-robin to NSPLIT programs per (token, head), each keeping an online softmax
(running max, sum, weighted values); a second launch merges the splits, with the attention sink
where the model has one (a buffer of up to KEYS_PER_SPLIT keys needs no merge: one launch). Only
the keys a query may see are read (up to its position, within its window, or those a mask shows:
DeepSeek-V4's, which are their own values), so a step over a buffer reserved far ahead costs what
its context costs. float32 all through; the split count is a function of the buffer's length
alone, so a step gives the same bits whatever its position."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_KEYS = 32  # keys per block of the online softmax
KEYS_PER_SPLIT = 512  # a buffer of S keys gets about S / this programs per (token, head), at most MAX_SPLITS
MAX_SPLITS = 16
SHARED_BLOCK_KEYS = 16  # keys per block where they are their own values and wider than 256 (DeepSeek-V4's 512)


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, vis_ptr, acc_ptr, ml_ptr, sink_ptr, o_ptr, H, G, S, D, DV, scale,
                    window, NSPLIT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                    WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, VISIBLE: tl.constexpr, SHARED_KV: tl.constexpr):
    """grid (T * H, NSPLIT): query head h of token t against the keys of kv head h // G that split
    s owns (with VISIBLE, those of the [T, S] mask, not those up to its position); writes its
    weighted values [DV] and its (max, sum) to the split buffers, or, when one split owns every
    key, the output itself (the merge's formula with one split). SHARED_KV: the values are the
    keys (DeepSeek-V4), read once."""
    row, split = tl.program_id(0), tl.program_id(1)
    t = row // H
    h = row % H
    hkv = h // G
    n_kv = H // G
    lo = 0
    hi = S
    if not VISIBLE:
        pos = tl.load(pos_ptr + t)
        if WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        hi = tl.minimum(pos + 1, S)
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(q_ptr + row.to(tl.int64) * D + d, mask=d < D, other=0.0)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([BDV], tl.float32)
    n_blocks = tl.cdiv(hi - lo, BS)
    for b in range(split, n_blocks, NSPLIT):
        s = lo + b * BS + tl.arange(0, BS)
        valid = s < hi
        if VISIBLE:
            valid &= tl.load(vis_ptr + t * S + s, mask=s < hi, other=0) != 0
        kp = k_ptr + (s.to(tl.int64)[:, None] * n_kv + hkv) * D + d[None, :]
        k = tl.load(kp, mask=valid[:, None] & (d < D)[None, :], other=0.0)
        score = tl.sum(k * q[None, :], axis=1) * scale
        score = tl.where(valid, score, -float("inf"))
        m_new = tl.maximum(m, tl.max(score, axis=0))
        shift = m_new
        if VISIBLE:  # no visible key yet: weigh the block 0, not exp(-inf + inf)
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(score - shift)
        alpha = tl.exp(m - shift)
        if SHARED_KV:
            v = k
        else:
            vp = v_ptr + (s.to(tl.int64)[:, None] * n_kv + hkv) * DV + dv[None, :]
            v = tl.load(vp, mask=valid[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    if NSPLIT == 1:
        top = m
        if HAS_SINK:
            sink = tl.load(sink_ptr + h)
            top = tl.maximum(m, sink)
        scale_m = tl.exp(m - top)
        total = l * scale_m
        if HAS_SINK:
            total += tl.exp(sink - top)
        tl.store(o_ptr + row.to(tl.int64) * DV + dv, acc * scale_m / total, mask=dv < DV)
    else:
        out = row.to(tl.int64) * NSPLIT + split
        tl.store(acc_ptr + out * DV + dv, acc, mask=dv < DV)
        tl.store(ml_ptr + out * 2, m)
        tl.store(ml_ptr + out * 2 + 1, l)


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, sink_ptr, o_ptr, H, DV, NSPLIT: tl.constexpr, BDV: tl.constexpr,
                  HAS_SINK: tl.constexpr):
    """grid (T * H,): the splits of one (token, head) merged; a sink logit joins the softmax's sum."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, NSPLIT)
    dv = tl.arange(0, BDV)
    m = tl.load(ml_ptr + (row * NSPLIT + sp) * 2)
    l = tl.load(ml_ptr + (row * NSPLIT + sp) * 2 + 1)
    top = tl.max(m, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + row % H)
        top = tl.maximum(top, sink)
    scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - top))
    total = tl.sum(l * scale, axis=0)
    if HAS_SINK:
        total += tl.exp(sink - top)
    acc = tl.load(acc_ptr + (row * NSPLIT + sp)[:, None] * DV + dv[None, :], mask=(dv < DV)[None, :], other=0.0)
    o = tl.sum(acc * scale[:, None], axis=0) / total
    tl.store(o_ptr + row * DV + dv, o, mask=dv < DV)


def splits_for(keys: int) -> int:
    """A power of two (the merge reads the splits as one vector)."""
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, math.ceil(keys / KEYS_PER_SPLIT))))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d] at `positions` [T] (int64, on the device) over k [S, Hkv, d], v [S, Hkv, dv]
    (keys at positions 0..S-1, a query seeing those <= its own, within `window`) -> [T, H, dv].
    `sinks` [H]: a logit per head that takes probability mass without a value. `visible` [T, S]
    (bool): the keys each query sees, in place of positions (None) and window (keys in any order)."""
    t, h, d = q.shape
    s, hkv, dv = v.shape
    nsplit = splits_for(s)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # views (MLA's expanded keys) are copied
    out = torch.empty((t, h, dv), dtype=torch.float32, device=q.device)
    sink = sinks.to(torch.float32).contiguous() if sinks is not None else out
    acc = torch.empty((t * h, nsplit, dv) if nsplit > 1 else (1,), dtype=torch.float32, device=q.device)
    ml = torch.empty((t * h, nsplit, 2) if nsplit > 1 else (1,), dtype=torch.float32, device=q.device)
    vis = visible.contiguous().view(torch.uint8) if visible is not None else positions
    positions = vis if positions is None else positions  # not read
    shared = k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.stride() == v.stride()
    bd = triton.next_power_of_2(d)
    block = SHARED_BLOCK_KEYS if shared and bd > 256 else BLOCK_KEYS
    _partial_kernel[(t * h, nsplit)](q, k, v, positions, vis, acc, ml, sink, out, h, h // hkv, s, d, dv, scale,
                                     window or 0, NSPLIT=nsplit, BS=block, BD=bd, BDV=triton.next_power_of_2(dv),
                                     WINDOW=window is not None, HAS_SINK=sinks is not None,
                                     VISIBLE=visible is not None, SHARED_KV=shared, num_warps=4)
    if nsplit > 1:
        _merge_kernel[(t * h,)](acc, ml, sink, out, h, dv, NSPLIT=nsplit, BDV=triton.next_power_of_2(dv),
                                HAS_SINK=sinks is not None, num_warps=4)
    return out
