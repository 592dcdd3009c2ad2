"""The small per-row operations of every layer, each in one launch instead of the five to ten torch
ops they take: RMSNorm and rotary embeddings. float32 in, float32 out, the formulas of layers.py."""

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
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, ROT: tl.constexpr, NEOX: tl.constexpr,
                 BD: tl.constexpr):
    """One (token, head) row of D channels; the first ROT are rotated, the rest copied."""
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    i = tl.arange(0, BD)
    x = tl.load(x_ptr + row * D + i, mask=i < D, other=0.0)
    half = ROT // 2
    if NEOX:  # pairs (i, i + half)
        partner = tl.where(i < half, i + half, i - half)
        f = i % half
        sign = tl.where(i < half, -1.0, 1.0)
    else:  # pairs (2f, 2f + 1)
        partner = i ^ 1
        f = i // 2
        sign = tl.where(i % 2 == 0, -1.0, 1.0)
    rot = i < ROT
    other = tl.load(x_ptr + row * D + partner, mask=rot, other=0.0)
    c = tl.load(cos_ptr + t * half + f, mask=rot, other=1.0)
    s = tl.load(sin_ptr + t * half + f, mask=rot, other=0.0)
    y = tl.where(rot, x * c + sign * other * s, x)
    tl.store(y_ptr + row * D + i, y, mask=i < D)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, neox: bool) -> torch.Tensor:
    """x [T, H, D] float32 with its first `rot` channels rotated by cos/sin [T, rot/2]."""
    t, h, d = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(t * h,)](x, cos.contiguous(), sin.contiguous(), out, h, d, ROT=rot, NEOX=neox,
                           BD=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4)
    return out
