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

from .quant import Q8_0_REGROUPED, check_supported, dequantize

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
        elif use_kernels(self.raw.device) and self.ggml_type is T.F32 and self.raw.data_ptr() % 4 == 0:
            # the bytes are the values: a view of the weight (read-only, as every caller uses it)
            values = self.raw.view(torch.float32).reshape(tuple(reversed(self.shape)))
        elif use_kernels(self.raw.device):  # one launch, and nothing a CUDA graph cannot capture
            from ..kernels.linear_tl import dequantize as decode

            values = decode(self.raw, self.kernel_type, self.shape[0], math.prod(self.shape[1:]))
            values = values.reshape(tuple(reversed(self.shape)))
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
        if use_kernels(picked.device):
            from ..kernels.linear_tl import dequantize as decode_rows

            out = decode_rows(picked, self.kernel_type, self.shape[0], picked.shape[0])
        else:
            out = dequantize(ungroup_q8_0(picked) if self.regrouped else picked, self.ggml_type,
                             (self.shape[0], picked.shape[0]))
        return out.reshape(*ids.shape, self.shape[0]).to(dtype)

    def to(self, device: torch.device | str) -> "QTensor":
        """On `device`, regrouped where the kernels run there (and back to GGUF order where not)."""
        raw = self.raw.to(device)
        regroup = (use_kernels(raw.device) and self.ggml_type is T.Q8_0 and len(self.shape) >= 2
                   and self.shape[0] % 256 == 0)
        if regroup and not self.regrouped:
            raw = regroup_q8_0(raw)
        elif self.regrouped and not regroup:
            raw = ungroup_q8_0(raw)
        return QTensor(self.name, self.ggml_type, self.shape, raw, regroup)


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


def linear_parts(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [T, in] @ w^T for a consumer that adds partial sums itself (layers.add_rms_norm, the
    q/k/v RoPE kernel, the routers): [T, S, out], S split-K parts on the fast path of a decode step,
    else [T, out], the sum."""
    if use_kernels(x.device) and x.dim() == 2:
        from ..kernels.linear_tl import MATVEC_MAX_ROWS, matvec_parts

        if x.shape[0] <= MATVEC_MAX_ROWS:
            k, n = w.shape[0], math.prod(w.shape[1:])
            return matvec_parts(x.to(torch.float32).contiguous(), w.raw, w.kernel_type, k, n)
    return linear(x, w)


def head_linear(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [T, H, K] times a matrix per head, w holding H matrices [R, K] one after another (ggml
    shape (K, R, H), or (K, H * R)) -> [T, H, R]: MLA's absorbed projections, DeepSeek-V4's grouped
    output. One launch on the fast path for a decode step; else the dequantized product."""
    t, h, k = x.shape
    r = math.prod(w.shape[1:]) // h
    if use_kernels(x.device):
        from ..kernels.linear_tl import MATVEC_MAX_ROWS, matvec_heads

        if t <= MATVEC_MAX_ROWS:
            return matvec_heads(x.to(torch.float32), w.raw, w.kernel_type, k, r).to(x.dtype)
    return torch.einsum("thk,hrk->thr", x, w.dequant(x.dtype).view(h, r, k))


def linear(x: torch.Tensor, w: QTensor, bias: QTensor | None = None) -> torch.Tensor:
    """x [..., in] @ w^T -> [..., out], with float32 accumulation."""
    if use_kernels(x.device):
        from ..kernels.linear_tl import matmul

        k, n = w.shape[0], math.prod(w.shape[1:])
        y = matmul(x.reshape(-1, k).to(torch.float32).contiguous(), w.raw, w.kernel_type, k, n)
        y = y.reshape(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias.dequant()
        return y.to(x.dtype)
    y = x @ w.dequant(x.dtype).T
    if bias is not None:
        y = y + bias.dequant(x.dtype)
    return y
