"""ggml blocks as torch tensors: a [n_blocks, block bytes] uint8 tensor split into the registry's
parts (packtools.quants) and the small unpackings every decoder shares (an f16 field, nibbles,
bits). Shared by the decoders of weights/quant.py and weights/quant_iq.py; no arithmetic on
values happens here, so nothing here can change a result's rounding."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from expertpack.packtools.quants import QUANTS


def parts(blocks: torch.Tensor, ggml_type: T) -> tuple[torch.Tensor, ...]:
    """[n, block bytes] -> the registry's parts of ggml_type in order, each [n, its bytes] (views)."""
    return torch.split(blocks, QUANTS[ggml_type].part_bytes, dim=1)


def f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _little_endian(b: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, width*m] bytes -> [n, m] unsigned values of `width` bytes, as `dtype`. Assembled byte by
    byte rather than viewed: a part need not sit at an aligned offset (IQ3_XXS's uint32 words sit at
    byte 66 of a block), and a wider signed dtype keeps torch's arithmetic shift from seeing a sign."""
    words = b.reshape(b.shape[0], -1, width).to(dtype)
    out = words[..., 0]
    for i in range(1, width):
        out = out | (words[..., i] << (8 * i))
    return out


def u16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2m] little-endian bytes -> [n, m] int32 (uint16 values)."""
    return _little_endian(b, 2, torch.int32)


def u32(b: torch.Tensor) -> torch.Tensor:
    """[n, 4m] little-endian bytes -> [n, m] int64 (uint32 values)."""
    return _little_endian(b, 4, torch.int64)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the low nibbles of all k bytes, then the high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: each byte's low nibble, then its high nibble (the 4-bit scales' order)."""
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(b.shape[0], -1)


def bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count/8] bytes -> [n, count] single bits, little-endian within each byte."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], count)
