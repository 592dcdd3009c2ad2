"""Weights as GGUF stores them: a QTensor is a tensor's raw bytes plus its ggml type and shape, kept
quantized in memory and dequantized per use. `linear` is the one place a quantized matrix meets an
activation, so a faster kernel (Triton on CUDA) replaces one function."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from .quant import check_supported, dequantize


@dataclass(frozen=True)
class QTensor:
    name: str
    ggml_type: T
    shape: tuple[int, ...]  # ggml ne: shape[0] is the contiguous row
    raw: torch.Tensor  # uint8, the bytes exactly as in the file

    def __post_init__(self) -> None:
        if self.ggml_type is not T.I32:
            check_supported(self.ggml_type, self.name)

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values in torch order (reversed ne), e.g. a matrix ne [in, out] -> [out, in]."""
        values = dequantize(self.raw, self.ggml_type, self.shape)
        return values if dtype is torch.float32 else values.to(dtype)

    def ints(self) -> torch.Tensor:
        """An integer tensor (I32), in torch order."""
        assert self.ggml_type is T.I32, self.name
        return self.raw.view(torch.int32).reshape(tuple(reversed(self.shape)))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of a matrix (an embedding lookup) without dequantizing the whole table."""
        row_bytes = self.raw.numel() // self.shape[1]
        picked = self.raw.reshape(self.shape[1], row_bytes)[ids.reshape(-1)]
        out = dequantize(picked, self.ggml_type, (self.shape[0], picked.shape[0]))
        return out.reshape(*ids.shape, self.shape[0]).to(dtype)

    def to(self, device: torch.device | str) -> "QTensor":
        return QTensor(self.name, self.ggml_type, self.shape, self.raw.to(device))


def linear(x: torch.Tensor, w: QTensor, bias: QTensor | None = None) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out], w dequantized for this use only."""
    y = x @ w.dequant(x.dtype).T
    if bias is not None:
        y = y + bias.dequant(x.dtype)
    return y
