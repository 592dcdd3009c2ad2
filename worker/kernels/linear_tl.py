"""Triton kernels for a quantized matrix meeting activations: `matvec` (a few rows of x, the decode
step: GGUF bytes decoded in registers, fp32 accumulation, deterministic split-K for short wide
matrices) and `dequantize` (the whole matrix once, for prefill's matrix products). The weight is
described by its raw bytes, ggml type and ggml shape [K, N], as in QTensor."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from expertpack.packtools.quants import nbytes_of

from ..weights.quant import Q8_0_REGROUPED
from ..weights.quant_iq import kernel_tables
from .dequant_tl import CHUNK, MXFP4, Q8_0, block_dot, chunk
from .iq_dot_tl import iq_dot, takes_iq_dot

BN_MATVEC = 16  # rows of W per program
BN_REGROUPED = 32  # the same for regrouped Q8_0: its 128-bit loads repay wider programs (kernel_bandwidth.py)
MATVEC_WARPS = 4
BN_DEQUANT = 16
PROGRAMS_PER_SM = 4  # split K until a matvec has this many programs per multiprocessor
# Up to this many rows of x, decode in registers; more, dequantize and multiply. A batched step of 16
# rows (bench/profile_batch.py, resident Q3-12L, H100): 11.93 ms with 16, 13.08 with 8; 4 and 8 rows alike.
MATVEC_MAX_ROWS = 16
DEQUANT_PIECE_VALUES = 1 << 24  # a prefill dequantizes a big matrix in pieces of 64 MiB of float32


def row_bytes(ggml_type: int, k: int) -> int:
    if ggml_type == Q8_0_REGROUPED:
        ggml_type = int(GGMLQuantizationType.Q8_0)
    return nbytes_of(GGMLQuantizationType(ggml_type), (k,))


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, y_ptr, tab, N, K, row_bytes, chunks_per_split, H,
                   QT: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """y[t, s, n] = sum over the chunks of split s of x[t, k] * W[h, n, k], h = t % H (a matrix per
    head for H > 1: x's rows are (token, head) pairs); grid (T*H, N/BN, splits)."""
    t, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S = tl.num_programs(2)
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    rowp = w_ptr + ((t % H) * N + n).to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros([BN], tl.float32)  # a chunk's products summed per row as decoded: fewer registers
    for i in range(0, chunks_per_split):  # the last split's spare chunks are masked (k >= K)
        c = s * chunks_per_split + i
        k = c * CH + j
        if QT == MXFP4 or QT == Q8_0:
            acc += block_dot(QT, rowp, c, (n < N)[:, None], K, tl.load(x_ptr + t * K + k, mask=k < K, other=0.0)[None, :])
        elif takes_iq_dot(QT):
            acc += iq_dot(QT, rowp, c, (n < N)[:, None], K, x_ptr + t * K + c * CH, tab)
        else:
            m = (n < N)[:, None] & (k < K)[None, :]
            w = chunk(QT, rowp, c, j[None, :], m, tab)
            xv = tl.load(x_ptr + t * K + k, mask=k < K, other=0.0)
            acc += tl.sum(w * xv[None, :], axis=1)
    tl.store(y_ptr + (t * S + s) * N + n, acc, mask=n < N)


@triton.jit
def _s8_value(words, k: tl.constexpr):
    """Byte k of each word, the int8 quant (words xored with 0x80808080: byte + 128) as an exact
    float32: placed as a float's mantissa under 2^23, 2^23 + 128 taken off."""
    return (((words >> (8 * k)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _matvec_q8_0r_kernel(x_ptr, w_ptr, y_ptr, N, K, row_bytes, chunks_per_split, H, BN: tl.constexpr):
    """_matvec_kernel for regrouped Q8_0 rows (weights.regroup_q8_0). A chunk's quants are 64
    aligned words: 128-bit loads, each word's four products summed against x at stride 4, a
    block's eight words summed, then times its scale; the blocks are summed once, after the loop.
    In the GGUF layout Triton spread a block over lanes and paid shuffles and barriers for every
    chunk: twice the instructions per value (bench/kernel_registers.py)."""
    t, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S = tl.num_programs(2)
    n = pid_n * BN + tl.arange(0, BN)
    rowp = w_ptr + ((t % H) * N + n).to(tl.int64)[:, None] * row_bytes
    wi = tl.arange(0, 64)[None, :]
    acc = tl.zeros([BN, 8], tl.float32)
    for i in range(0, chunks_per_split):  # the last split's spare chunks are masked (c * 256 >= K)
        c = s * chunks_per_split + i
        kin = c * 256 < K
        m = (n < N)[:, None] & kin
        bp = rowp + c * 272
        words = tl.load((bp + 16).to(tl.pointer_type(tl.uint32)) + wi, mask=m, other=0) ^ 0x80808080
        xp = x_ptr + t * K + c * 256 + wi * 4
        p = _s8_value(words, 0) * tl.load(xp, mask=kin, other=0.0)
        p += _s8_value(words, 1) * tl.load(xp + 1, mask=kin, other=0.0)
        p += _s8_value(words, 2) * tl.load(xp + 2, mask=kin, other=0.0)
        p += _s8_value(words, 3) * tl.load(xp + 3, mask=kin, other=0.0)
        d = tl.load(bp.to(tl.pointer_type(tl.float16)) + tl.arange(0, 8)[None, :], mask=m, other=0).to(tl.float32)
        acc += tl.sum(tl.reshape(p, (BN, 8, 8)), axis=2) * d
    tl.store(y_ptr + (t * S + s) * N + n, tl.sum(acc, axis=1), mask=n < N)


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, tab, N, K, row_bytes, QT: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """out[n, k] = W[n, k] as float32; grid (N/BN, K/CH)."""
    pid_n, c = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    k = c * CH + j
    m = (n < N)[:, None] & (k < K)[None, :]
    rowp = w_ptr + n.to(tl.int64)[:, None] * row_bytes
    w = chunk(QT, rowp, c, j[None, :], m, tab)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + k[None, :], w, mask=m)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are plenty
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(n_rows: int, k: int, device: torch.device, bn: int) -> int:
    """Split K so that a short wide matrix (a router, an attention projection) still gives every
    multiprocessor PROGRAMS_PER_SM programs; a function of the shape, the rows a program takes (its
    weights' layout) and the GPU alone, so the same step gives the same bits whatever feeds it (the
    resident table or the cache)."""
    blocks = math.ceil(n_rows / bn)
    chunks = math.ceil(k / CHUNK)
    return max(1, min(chunks, math.ceil(PROGRAMS_PER_SM * _sm_count(device) / blocks)))


def matvec_parts(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, n: int) -> torch.Tensor:
    """x [T, K] float32 (contiguous) @ W^T, W the quantized [N, K] at raw, as [T, S, N] float32: the
    S split-K partial sums, for a fused consumer (a norm, RoPE, a router) to add in split order
    instead of a launch of their own."""
    t = x.shape[0]
    splits = splits_for(n, k, x.device, _rows_per_program(ggml_type))
    per_split = math.ceil(math.ceil(k / CHUNK) / splits)
    splits = math.ceil(math.ceil(k / CHUNK) / per_split)
    y = torch.empty((t, splits, n), dtype=torch.float32, device=x.device)
    _launch_matvec(x, raw, y, ggml_type, k, n, t, splits, per_split, 1)
    return y


def _rows_per_program(ggml_type: int) -> int:
    return BN_REGROUPED if ggml_type == Q8_0_REGROUPED else BN_MATVEC


def _launch_matvec(x: torch.Tensor, raw: torch.Tensor, y: torch.Tensor, ggml_type: int, k: int, n: int,
                   x_rows: int, splits: int, per_split: int, heads: int) -> None:
    """The matvec kernel for the weights' layout, over grid (x_rows, N / rows per program, splits):
    x's rows on the first axis, so that the programs of one block of W for every row run together
    and the block comes from HBM once, then from L2. Blocks first, a batched step read a matrix
    larger than L2 (lm_head: 330 MB at Qwen3-30B-A3B's Q8_0) from HBM once per row."""
    bn = _rows_per_program(ggml_type)
    grid = (x_rows, triton.cdiv(n, bn), splits)
    if ggml_type == Q8_0_REGROUPED:
        _matvec_q8_0r_kernel[grid](x, raw, y, n, k, row_bytes(ggml_type, k), per_split, heads, BN=bn,
                                   num_warps=MATVEC_WARPS)
    else:
        _matvec_kernel[grid](x, raw, y, kernel_tables(x.device), n, k, row_bytes(ggml_type, k), per_split, heads,
                             QT=ggml_type, BN=bn, CH=CHUNK, num_warps=MATVEC_WARPS)


def matvec_heads(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, n: int) -> torch.Tensor:
    """x [T, H, K] float32 against a matrix per head (raw holds H matrices [N, K], head-major) ->
    [T, H, N] float32: MLA's absorbed projections, every head in one launch."""
    t, h, _ = x.shape
    y = torch.empty((t * h, 1, n), dtype=torch.float32, device=x.device)
    _launch_matvec(x.contiguous(), raw, y, ggml_type, k, n, t * h, 1, math.ceil(k / CHUNK), h)
    return y.view(t, h, n)


def matvec(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, n: int) -> torch.Tensor:
    """x [T, K] float32 (contiguous) @ W^T -> [T, N] float32, W the quantized [N, K] at raw."""
    y = matvec_parts(x, raw, ggml_type, k, n)
    return y[:, 0] if y.shape[1] == 1 else y.sum(1)


def dequantize(raw: torch.Tensor, ggml_type: int, k: int, n: int) -> torch.Tensor:
    """The [N, K] float32 matrix at raw."""
    out = torch.empty((n, k), dtype=torch.float32, device=raw.device)
    grid = (triton.cdiv(n, BN_DEQUANT), triton.cdiv(k, CHUNK))
    _dequant_kernel[grid](raw, out, kernel_tables(raw.device), n, k, row_bytes(ggml_type, k), QT=ggml_type, BN=BN_DEQUANT, CH=CHUNK,
                          num_warps=4)
    return out


def matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, n: int) -> torch.Tensor:
    """x [T, K] float32 @ W^T -> [T, N] float32. A few rows (decode) read the bytes once in
    registers; many rows (prefill) dequantize W once, in pieces, for cuBLAS's float32 product."""
    if x.shape[0] <= MATVEC_MAX_ROWS:
        return matvec(x, raw, ggml_type, k, n)
    rows = max(BN_DEQUANT, DEQUANT_PIECE_VALUES // k // BN_DEQUANT * BN_DEQUANT)
    if rows >= n:
        return x @ dequantize(raw, ggml_type, k, n).T
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    rb = row_bytes(ggml_type, k)
    for n0 in range(0, n, rows):
        m = min(rows, n - n0)
        out[:, n0:n0 + m] = x @ dequantize(raw[n0 * rb:(n0 + m) * rb], ggml_type, k, m).T
    return out
