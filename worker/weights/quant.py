"""GGUF dequantization in torch, the same code on CPU and CUDA, bit for bit equal to gguf-py's
reference (`gguf.quants.dequantize`): every formula below performs the reference's float32
operations in the reference's order, with no fused multiply-add, so IEEE rounding gives the very
same values. Weights stay quantized in memory; `dequantize` runs per use.

Block layouts are packtools.quants' (the one registry of ggml types): each formula splits a block
into the registry's parts (weights/blocks.py) and keeps only the arithmetic. The table-driven types
(i-quants, ternary quants) have their formulas in weights/quant_iq.py, registered in the same table.
A type the registry does not mark decoded is refused when a model loads (`check_supported`), never
in the middle of a generation."""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType as T

from expertpack.packtools.quants import DECODED, QK_K, QUANTS

from .blocks import bits, f16, nibbles, parts
from .quant_iq import IQ_DEQUANT

# The kernels' type id for Q8_0 rows rewritten by qtensor.regroup_q8_0 (no ggml type has it).
Q8_0_REGROUPED = 264
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


class UnsupportedType(ValueError):
    """A tensor's ggml type has no dequantizer here (one gguf-py added after ours, e.g. NVFP4)."""


def check_supported(ggml_type: T, tensor: str) -> None:
    if ggml_type not in DECODED:
        raise UnsupportedType(f"unsupported ggml type {ggml_type.name} in tensor {tensor}; this worker dequantizes "
                              f"{', '.join(t.name for t in DECODED)}")


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: uint8 bytes of a tensor (any shape, contiguous); shape: its ggml ne. Returns float32 in
    numpy/torch order (reversed ne), on raw's device."""
    if ggml_type not in DECODED:
        raise UnsupportedType(f"unsupported ggml type {ggml_type.name}")
    blocks = raw.reshape(-1, QUANTS[ggml_type].nbytes)
    values = _DEQUANT[ggml_type](blocks)
    return values.reshape(tuple(reversed(shape)))


# ---- one function per type, each the reference's arithmetic ------------------------------------
def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = parts(blocks, T.Q4_0)
    d = f16(d)
    q = nibbles(qs).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = parts(blocks, T.Q4_1)
    d, m = f16(d), f16(m)
    q = nibbles(qs).to(torch.float32)
    return (d * q) + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = parts(blocks, T.Q5_0)
    d = f16(d)
    qh = bits(qh, 32)
    q = (nibbles(qs) | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = parts(blocks, T.Q5_1)
    d, m = f16(d), f16(m)
    qh = bits(qh, 32)
    q = (nibbles(qs) | (qh << 4)).to(torch.float32)
    return (d * q) + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = parts(blocks, T.Q8_0)
    d = f16(d)
    x = qs.contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs, d, dmin = parts(blocks, T.Q2_K)
    d, dmin = f16(d), f16(dmin)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3  # [n, 2 halves, 4 shifts, 32]
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, packed, d = parts(blocks, T.Q3_K)
    d = f16(d)
    low = torch.cat([packed[:, :8] & 0x0F, packed[:, :8] >> 4], dim=-1)  # [n, 16]
    high = packed[:, 8:12]
    high = torch.cat([(high >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-1)  # [n, 16]
    scales = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 16, 1)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16)
    bit = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 1, 8, 1)
    qh = ((hmask.reshape(n, 1, 1, 32) >> bit) & 1).reshape(n, 16, 16) ^ 1  # set bit: no offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = parts(blocks, T.Q4_K)
    d, dmin = f16(d), f16(dmin)
    sc, mn = _k_scales(scales)
    dd = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    qs = qs.reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).to(torch.float32)
    return (dd * q - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = parts(blocks, T.Q5_K)
    d, dmin = f16(d), f16(dmin)
    sc, mn = _k_scales(scales)
    dd = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = qs.reshape(n, 4, 1, 32)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    bit = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 8, 1)
    qh = ((qh.reshape(n, 1, 32) >> bit) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dd * q - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = parts(blocks, T.Q6_K)
    scales = scales.contiguous().view(torch.int8).to(torch.float32)
    d = f16(d)
    dd = (d * scales).reshape(n, 16, 1)
    low = ql.reshape(n, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dd * q).reshape(n, QK_K)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as float32, exact (a subnormal below e = 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e, qs = parts(blocks, T.MXFP4)
    d = _e8m0_half(e)
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    q = table[nibbles(qs).to(torch.int64)]
    return d * q


_DEQUANT: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _f32,
    T.F16: _f16_values,
    T.BF16: _bf16,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.MXFP4: _mxfp4,
    **IQ_DEQUANT,
}
assert set(_DEQUANT) == set(DECODED)
