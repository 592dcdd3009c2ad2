"""Weights as GGUF stores them: a QTensor is a tensor's raw bytes plus its ggml type and shape, kept
quantized in memory. `linear` is the one place a quantized matrix meets an activation: on CUDA the
Triton kernels decode the bytes in registers (kernels/linear_tl.py); elsewhere the matrix is
dequantized for this use only, in torch (the CPU path and the reference). Vectors (norms, biases)
are small and read every step: their float32 values are kept once made."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from gguf import GGMLQuantizationType as T

from .quant import check_supported, dequantize

_kernels_on_cpu = False


def use_kernels(device: torch.device) -> bool:
    """Whether the Triton fast path runs on `device`: CUDA always; the CPU only inside
    `kernels_on_cpu()` (Triton's interpreter, for tests)."""
    return device.type == "cuda" or (device.type == "cpu" and _kernels_on_cpu)


@contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Runs the fast path on the CPU through Triton's interpreter, which is how CI checks the
    kernels' wiring without a GPU. Triton must see TRITON_INTERPRET=1 when the kernels are defined
    and while they run (it imports parts of itself lazily)."""
    global _kernels_on_cpu
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _kernels_on_cpu = True
    try:
        yield
    finally:
        _kernels_on_cpu = False
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


@dataclass(frozen=True)
class QTensor:
    name: str
    ggml_type: T
    shape: tuple[int, ...]  # ggml ne: shape[0] is the contiguous row
    raw: torch.Tensor  # uint8, the bytes exactly as in the file
    # A vector's float32 values, made at its first use and shared by every later one (read-only).
    _values: torch.Tensor | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ggml_type is not T.I32:
            check_supported(self.ggml_type, self.name)

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values in torch order (reversed ne), e.g. a matrix ne [in, out] -> [out, in]."""
        if len(self.shape) == 1:
            values = self._values
            if values is None:
                values = dequantize(self.raw, self.ggml_type, self.shape)
                object.__setattr__(self, "_values", values)  # a cache, not state: frozen stays frozen
        elif use_kernels(self.raw.device):  # one launch, and nothing a CUDA graph cannot capture
            from .kernels.linear_tl import dequantize as decode

            values = decode(self.raw, int(self.ggml_type), self.shape[0], math.prod(self.shape[1:]))
            values = values.reshape(tuple(reversed(self.shape)))
        else:
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
        if use_kernels(picked.device):
            from .kernels.linear_tl import dequantize as decode_rows

            out = decode_rows(picked, int(self.ggml_type), self.shape[0], picked.shape[0])
        else:
            out = dequantize(picked, self.ggml_type, (self.shape[0], picked.shape[0]))
        return out.reshape(*ids.shape, self.shape[0]).to(dtype)

    def to(self, device: torch.device | str) -> "QTensor":
        return QTensor(self.name, self.ggml_type, self.shape, self.raw.to(device))


def stacked_rows(name: str, parts: list[QTensor]) -> QTensor | None:
    """Matrices of one type and row length stacked into one (their output rows concatenated, bytes
    for bytes), so that one launch multiplies them all; None where they cannot be (types or row
    lengths differ). Vectors (biases) stack likewise."""
    first = parts[0]
    if any(p.ggml_type is not first.ggml_type or len(p.shape) != len(first.shape) or
           (len(p.shape) == 2 and p.shape[0] != first.shape[0]) for p in parts):
        return None
    raw = torch.cat([p.raw.reshape(-1) for p in parts])
    if len(first.shape) == 1:
        return QTensor(name, first.ggml_type, (sum(p.shape[0] for p in parts),), raw)
    return QTensor(name, first.ggml_type, (first.shape[0], sum(p.shape[1] for p in parts)), raw)


def linear_parts(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [T, in] @ w^T for a consumer that adds partial sums itself (layers.add_rms_norm, the
    q/k/v RoPE kernel, the routers): [T, S, out], S split-K parts on the fast path of a decode step,
    else [T, out], the sum."""
    if use_kernels(x.device) and x.dim() == 2:
        from .kernels.linear_tl import MATVEC_MAX_ROWS, matvec_parts

        if x.shape[0] <= MATVEC_MAX_ROWS:
            k, n = w.shape[0], math.prod(w.shape[1:])
            return matvec_parts(x.to(torch.float32).contiguous(), w.raw, int(w.ggml_type), k, n)
    return linear(x, w)


def head_linear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [T, H, K] times a matrix per head, w holding H matrices [R, K] one after another (ggml
    shape (K, R, H), or (K, H * R)) -> [T, H, R]: MLA's absorbed projections, DeepSeek-V4's grouped
    output. One launch on the fast path for a decode step; else the dequantized product."""
    t, h, k = x.shape
    r = math.prod(w.shape[1:]) // h
    if use_kernels(x.device):
        from .kernels.linear_tl import MATVEC_MAX_ROWS, matvec_heads

        if t <= MATVEC_MAX_ROWS:
            return matvec_heads(x.to(torch.float32), w.raw, int(w.ggml_type), k, r).to(x.dtype)
    return torch.einsum("thk,hrk->thr", x, w.dequant(x.dtype).view(h, r, k))


def linear(x: torch.Tensor, w: QTensor, bias: QTensor | None = None) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out], with float32 accumulation."""
    if use_kernels(x.device):
        from .kernels.linear_tl import matmul

        k, n = w.shape[0], math.prod(w.shape[1:])
        y = matmul(x.reshape(-1, k).to(torch.float32).contiguous(), w.raw, int(w.ggml_type), k, n)
        y = y.reshape(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias.dequant()
        return y.to(x.dtype)
    y = x @ w.dequant(x.dtype).T
    if bias is not None:
        y = y + bias.dequant(x.dtype)
    return y
