"""A prompt's trunk products with the weights decoded on chip: x [T, K] float32 times a quantized
W [N, K] in its GGUF bytes, a program taking a tile of BM rows of x and BN rows of W and meeting
each step of K decoded in registers (moe_grouped's products, for one matrix and every token). The
other way, linear_tl.matmul dequantizes W to float32 in memory for cuBLAS's float32 product, which
runs on the CUDA cores; here the products run on tensor cores in three bfloat16 passes, as
accurate as float32 ones (moe_grouped._part), and nothing is written but the result.

The grid's first axis walks the row tiles of x, so the programs that read one block of W run side
by side and read its bytes from L2 after the first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from .moe_grouped import STEP, WITH_MINS, product_step
from .moe_grouped import decodes_type as decodes  # the types whose bytes it reads

BM, BN = 64, 64  # rows of x, rows of W
WARPS = 4
# Types whose decoding leaves ptxas short of registers at 4 warps (bench/kernel_registers.py, sm_90:
# spills of 188 B for Q8_0 in GGUF order, 72 for Q4_K, 688 for Q5_K): 8 warps, none.
WARPS_8 = {int(T.Q8_0), int(T.Q4_K), int(T.Q5_K)}
PRECISION = "bf16x3"


def launch_args(ggml_type: int) -> dict:
    """A launch's constants and warps for this type (bench/kernel_registers.py compiles the same)."""
    return {"QT": ggml_type, "MINS": ggml_type in WITH_MINS, "BK": STEP[ggml_type], "BM": BM, "BN": BN,
            "PRECISION": PRECISION, "num_warps": 8 if ggml_type in WARPS_8 else WARPS}


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, T, N, K, row_bytes, QT: tl.constexpr, MINS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                   OPERAND: tl.constexpr):
    """y[t, n] = W[n] . x[t]; grid (T/BM, N/BN)."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = r < T
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    rowp = w_ptr + n.to(tl.int64)[:, None] * row_bytes
    xrow = x_ptr + r.to(tl.int64)[:, None] * K
    j = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for b in range(0, K // BK):
        a = tl.load(xrow + b * BK + j[None, :], mask=rm[:, None], other=0.0)
        acc = product_step(QT, rowp, b, nm[:, None], a, acc, MINS, PRECISION, OPERAND)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * N + n[None, :], acc, mask=rm[:, None] & nm[None, :])


def matmul_decoded(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, k: int, n: int, row_bytes: int) -> torch.Tensor:
    """x [T, K] float32 (contiguous) @ W^T -> [T, N] float32, W [N, K] the rows of `raw`, each
    `row_bytes` long, of a type `decodes` accepts."""
    t = x.shape[0]
    y = torch.empty((t, n), dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    _matmul_kernel[(triton.cdiv(t, BM), triton.cdiv(n, BN))](
        x, raw, y, t, n, k, row_bytes, **launch_args(ggml_type), OPERAND=tl.bfloat16 if x.is_cuda else tl.float32)
    return y
