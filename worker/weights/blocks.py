"""ggml blocks as torch tensors: a [n_blocks, block bytes] uint8 tensor split into the registry's
parts (packtools.quants) and the small unpackings every decoder shares (an f16 field, nibbles,
bits). Shared by the decoders; no arithmetic on values happens here, so nothing here can change a
result's rounding."""

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


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the low nibbles of all k bytes, then the high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count/8] bytes -> [n, count] single bits, little-endian within each byte."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], count)
