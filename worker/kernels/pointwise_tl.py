"""The small per-row operations of every layer, each in one launch instead of the five to ten torch
ops they take: RMSNorm (with the residual add before it) and rotary embeddings. float32 in, float32 out, the formulas of layers.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, HAS_WEIGHT: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0)
    tl.store(y_ptr + row * D + d, y, mask=d < D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] float32 normalized over its last dimension, times weight [D] where given."""
    d = x.shape[-1]
    flat = x.reshape(-1, d).contiguous()
    out = torch.empty_like(flat)
    _rms_norm_kernel[(flat.shape[0],)](flat, weight if weight is not None else flat, out, d, eps,
                                       HAS_WEIGHT=weight is not None, BD=triton.next_power_of_2(d),
                                       num_warps=4 if d <= 4096 else 8)
    return out.reshape(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, y_ptr, D, eps, PARTS: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr, BD: tl.constexpr):
    """sum = x + (the PARTS rows of delta added in order); y = rms_norm(sum) * weight."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    delta = tl.load(d_ptr + row * PARTS * D + d, mask=d < D, other=0.0)
    for i in tl.static_range(1, PARTS):
        delta += tl.load(d_ptr + (row * PARTS + i) * D + d, mask=d < D, other=0.0)
    x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0) + delta
    tl.store(sum_ptr + row * D + d, x, mask=d < D)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0)
    tl.store(y_ptr + row * D + d, y, mask=d < D)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] plus delta ([T, D], or [T, n, D] whose n rows are added first, in order), and that
    sum normalized, times weight: the residual stream and the next block's input in one launch."""
    t, d = x.shape
    parts = delta.shape[1] if delta.dim() == 3 else 1
    x, delta = x.contiguous(), delta.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(t,)](x, delta, weight if weight is not None else x, total, out, d, eps, PARTS=parts,
                               HAS_WEIGHT=weight is not None, BD=triton.next_power_of_2(d),
                               num_warps=4 if d <= 4096 else 8)
    return total, out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, START, ROT: tl.constexpr, NEOX: tl.constexpr,
                 INVERSE: tl.constexpr, BD: tl.constexpr):
    """One (token, head) row of D channels; ROT of them from START are rotated (backwards where
    INVERSE: by -sin), the rest copied."""
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    i = tl.arange(0, BD)
    x = tl.load(x_ptr + row * D + i, mask=i < D, other=0.0)
    half = ROT // 2
    k = i - START  # the channel's index among the rotated ones
    if NEOX:  # pairs (k, k + half)
        partner = tl.where(k < half, k + half, k - half)
        f = k % half
        sign = tl.where(k < half, -1.0, 1.0)
    else:  # pairs (2f, 2f + 1)
        partner = k ^ 1
        f = k // 2
        sign = tl.where(k % 2 == 0, -1.0, 1.0)
    if INVERSE:
        sign = -sign
    rot = (k >= 0) & (k < ROT)
    other = tl.load(x_ptr + row * D + START + partner, mask=rot, other=0.0)
    c = tl.load(cos_ptr + t * half + f, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * half + f, mask=rot, other=0.0)
    y = tl.where(rot, x * c + sign * other * s, x)
    tl.store(y_ptr + row * D + i, y, mask=i < D)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, neox: bool, start: int = 0,
         inverse: bool = False) -> torch.Tensor:
    """x [T, H, D] float32 with `rot` channels from `start` rotated by cos/sin [T, rot/2] (by -sin
    where `inverse`: undoing the rotation)."""
    t, h, d = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(t * h,)](x, cos.contiguous(), sin.contiguous(), out, h, d, start, ROT=rot, NEOX=neox,
                           INVERSE=inverse, BD=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4)
    return out


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, keys_ptr, values_ptr,
                           H, HKV, D, eps, PARTS: tl.constexpr, HAS_NORM: tl.constexpr, ROT: tl.constexpr,
                           NEOX: tl.constexpr, BD: tl.constexpr):
    """grid (T * (H + HKV),): a query head (normed, rotated, into q) or a kv head (its key normed,
    rotated and its value, written into the cache buffers at the token's position). The
    projection is the sum of PARTS rows (split-K partial sums, added in order)."""
    r = tl.program_id(0)
    t = r // (H + HKV)
    i = r % (H + HKV)
    width = (H + 2 * HKV) * D
    row_ptr = qkv_ptr + t.to(tl.int64) * PARTS * width + i * D
    d = tl.arange(0, BD)
    half = ROT // 2
    if NEOX:
        partner = tl.where(d < half, d + half, d - half)
        f = d % half
        sign = tl.where(d < half, -1.0, 1.0)
    else:
        partner = d ^ 1
        f = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    rot = d < ROT
    x = tl.load(row_ptr + d, mask=d < D, other=0.0)
    other = tl.load(row_ptr + partner, mask=rot, other=0.0)
    for p in tl.static_range(1, PARTS):
        x += tl.load(row_ptr + p * width + d, mask=d < D, other=0.0)
        other += tl.load(row_ptr + p * width + partner, mask=rot, other=0.0)
    if HAS_NORM:  # the head's own norm weight: q's for a query head, k's for a key (one load is masked off)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        is_q = i < H
        w = (tl.load(qn_ptr + d, mask=(d < D) & is_q, other=0.0)
             + tl.load(kn_ptr + d, mask=(d < D) & (not is_q), other=0.0))
        wp = (tl.load(qn_ptr + partner, mask=rot & is_q, other=0.0)
              + tl.load(kn_ptr + partner, mask=rot & (not is_q), other=0.0))
        x = x * inv * w
        other = other * inv * wp
    c = tl.load(cos_ptr + t * half + f, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * half + f, mask=rot, other=0.0)
    y = tl.where(rot, x * c + sign * other * s, x)
    if i < H:
        tl.store(q_ptr + (t.to(tl.int64) * H + i) * D + d, y, mask=d < D)
    else:
        slot = (tl.load(pos_ptr + t) * HKV + (i - H)) * D
        tl.store(keys_ptr + slot + d, y, mask=d < D)
        v = tl.load(row_ptr + HKV * D + d, mask=d < D, other=0.0)
        for p in tl.static_range(1, PARTS):
            v += tl.load(row_ptr + p * width + HKV * D + d, mask=d < D, other=0.0)
        tl.store(values_ptr + slot + d, v, mask=d < D)


def qkv_rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, rot: int, neox: bool,
                   keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * d] float32 (a stacked q/k/v projection; or [T, S, ...], S partial sums
    added in order) -> q [T, H, d] normed (per head,
    where q_norm/k_norm are given) and rotated; the keys, likewise, and the values go into
    keys/values [S, Hkv, d] at `positions` [T]. One launch for what layers.gqa_attention does in six."""
    t = qkv.shape[0]
    d = keys.shape[-1]
    qkv = qkv.contiguous()
    q = torch.empty((t, heads, d), dtype=torch.float32, device=qkv.device)
    has_norm = q_norm is not None
    _qkv_rope_store_kernel[(t * (heads + kv_heads),)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos.contiguous(), sin.contiguous(),
        positions, q, keys, values, heads, kv_heads, d, eps, PARTS=qkv.shape[1] if qkv.dim() == 3 else 1,
        HAS_NORM=has_norm, ROT=rot, NEOX=neox,
        BD=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4)
    return q
