"""Weights as GGUF stores them: a QTensor is a tensor's raw bytes plus its ggml type and shape, kept
quantized in memory, and torch's decoding of them (the CPU path and the reference). Where the
kernels run, nn/triton_ops.py decodes the same bytes in registers as it multiplies them. Vectors
(norms, biases) are small and read every step: their float32 values are kept once made."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as T

from .quant import Q8_0_REGROUPED, check_supported, dequantize

def regroup_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes whose every eight blocks (a 256-value chunk, 272 bytes) are rewritten as their
    eight float16 scales, then their 256 quants. The same bytes, and each chunk where it was, so a
    row keeps its length and place (row views, stacks and pieces work as before); but a chunk's
    quants are now 256 contiguous bytes 16 bytes in, which the decode kernel reads as 128-bit loads
    and sums without a shuffle, where 34-byte blocks made it cut every word from two
    (kernels/linear_tl.py). For rows whose length is a multiple of 256 values."""
    chunks = raw.view(-1, 8, 34)
    return torch.cat([chunks[:, :, :2].reshape(-1, 16), chunks[:, :, 2:].reshape(-1, 256)], dim=1).reshape(-1)


def ungroup_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """The GGUF bytes of regroup_q8_0's."""
    chunks = raw.view(-1, 272)
    return torch.cat([chunks[:, :16].reshape(-1, 8, 2), chunks[:, 16:].reshape(-1, 8, 32)], dim=2).reshape(-1)


@dataclass(frozen=True)
class QTensor:
    name: str
    ggml_type: T
    shape: tuple[int, ...]  # ggml ne: shape[0] is the contiguous row
    raw: torch.Tensor  # uint8, the bytes as in the file (regrouped: as regroup_q8_0 leaves them)
    regrouped: bool = False  # Q8_0 bytes in regroup_q8_0's order: done where the kernels run (`to`)
    # A vector's float32 values, made at its first use and shared by every later one (read-only).
    _values: torch.Tensor | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ggml_type is not T.I32:
            check_supported(self.ggml_type, self.name)

    @property
    def kernel_type(self) -> int:
        """The type id the Triton kernels decode these bytes as."""
        return Q8_0_REGROUPED if self.regrouped else int(self.ggml_type)

    def gguf_raw(self) -> torch.Tensor:
        """The bytes in GGUF order (torch's dequantization reads only those)."""
        return ungroup_q8_0(self.raw) if self.regrouped else self.raw

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values in torch order (reversed ne), e.g. a matrix ne [in, out] -> [out, in]."""
        if len(self.shape) == 1:
            values = self._values
            if values is None:
                values = dequantize(self.gguf_raw(), self.ggml_type, self.shape)
                object.__setattr__(self, "_values", values)  # a cache, not state: frozen stays frozen
        else:
            values = dequantize(self.gguf_raw(), self.ggml_type, self.shape)
        return values if dtype is torch.float32 else values.to(dtype)

    def ints(self) -> torch.Tensor:
        """An integer tensor (I32), in torch order."""
        assert self.ggml_type is T.I32, self.name
        return self.raw.view(torch.int32).reshape(tuple(reversed(self.shape)))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of a matrix (an embedding lookup) without dequantizing the whole table."""
        row_bytes = self.raw.numel() // self.shape[1]
        picked = self.raw.reshape(self.shape[1], row_bytes)[ids.reshape(-1)]
        out = dequantize(ungroup_q8_0(picked) if self.regrouped else picked, self.ggml_type,
                         (self.shape[0], picked.shape[0]))
        return out.reshape(*ids.shape, self.shape[0]).to(dtype)

    def to(self, device: torch.device | str, kernels: bool = False) -> "QTensor":
        """On `device`, regrouped for the kernels where they run there (`kernels`), else in GGUF order."""
        raw = self.raw.to(device)
        regroup = kernels and self.ggml_type is T.Q8_0 and len(self.shape) >= 2 and self.shape[0] % 256 == 0
        if regroup and not self.regrouped:
            raw = regroup_q8_0(raw)
        elif self.regrouped and not regroup:
            raw = ungroup_q8_0(raw)
        return QTensor(self.name, self.ggml_type, self.shape, raw, regroup)

    def pinned(self, kernels: bool = False) -> "QTensor":
        """In page-locked host memory, which the GPU reads in place (kernels/host_rows_tl.py), laid
        out as `to` lays it out for a device (`kernels`)."""
        on_host = self.to("cpu", kernels)
        return QTensor(self.name, self.ggml_type, self.shape, on_host.raw.pin_memory(), on_host.regrouped)


def stacked_rows(name: str, parts: list[QTensor]) -> QTensor | None:
    """Matrices of one type and row length stacked into one (their output rows concatenated, bytes
    for bytes), so that one launch multiplies them all; None where they cannot be (types or row
    lengths differ). Vectors (biases) stack likewise."""
    first = parts[0]
    if any(p.ggml_type is not first.ggml_type or p.regrouped != first.regrouped or len(p.shape) != len(first.shape) or
           (len(p.shape) == 2 and p.shape[0] != first.shape[0]) for p in parts):
        return None
    raw = torch.cat([p.raw.reshape(-1) for p in parts])
    if len(first.shape) == 1:
        return QTensor(name, first.ggml_type, (sum(p.shape[0] for p in parts),), raw)
    return QTensor(name, first.ggml_type, (first.shape[0], sum(p.shape[1] for p in parts)), raw, first.regrouped)
