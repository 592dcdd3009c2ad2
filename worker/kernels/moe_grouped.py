"""A prefill's MXFP4 experts as grouped matrix products with the weights decoded on chip: the step's
pairs sorted by expert (expert_tiles.py), a program takes a tile of up to BM pairs of one expert and
BN rows of one of its matrices, and meets each 32-value block of those rows, decoded from the GGUF
bytes in registers (dequant_tl.mxfp4_block), with the pairs' activations on tensor cores. moe_dense
writes every selected expert out as float32 first and reads it back: for DeepSeek-V4-Flash's 256
experts at 512 tokens that is 26 GB a layer, where their bytes are 3.4 GB; here each expert's bytes
are read once per tile of its pairs and nothing is written but the results.

Precision: float32 activations, fp32 accumulation, the products as accurate as float32 ones. Tiles
of BM pairs multiply on TF32 tensor cores in three passes (`tf32x3`, as moe_dense); tiles of BM_WIDE,
whose products bind a long prompt, in three bfloat16 passes that the MXFP4 weights allow (`bf16x3`,
_dot: twice TF32's rate, its error against float32 per-pair products the same as tf32x3's), where
at BM pairs they measured slower (bench/moe_prefill.py).
A pair's row is computed by a tile of fixed shape over K in a fixed order, whichever other pairs
share the tile, and the tile shape by the whole step's, so a cache that loads a step's experts in
waves gives the very bits of the resident table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from ..nn.activation import Activation
from ..weights.expert_roles import ExpertRoles
from .dequant_tl import mxfp4_block
from .expert_tiles import expert_tiles, tile_at
from .moe_tl import _act

BM, BN, BK = 16, 64, 32  # a product's tile: pairs of one expert x rows of its matrix x a block of K
BM_WIDE, WIDE_PAIRS = 64, 32  # from this many pairs per routed expert, tiles of BM_WIDE pairs
BN_WIDE = 128  # and of BN_WIDE rows: a long prompt's tiles, fastest at this width (bench/decode_settings.py)
WARPS = 4
MXFP4 = int(GGMLQuantizationType.MXFP4)  # the type whose blocks it decodes, and where it measured faster
PRECISION, PRECISION_WIDE = "tf32x3", "bf16x3"  # the products of tiles of BM and of BM_WIDE pairs: see _dot


@triton.jit
def _bf16_part(v):
    """v's sign, exponent and top 7 mantissa bits (a bfloat16 value, held in float32)."""
    return (v.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, w, acc, PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """acc + a @ w.T for float32 activations a [BM, BK] and decoded MXFP4 weights w [BN, BK].
    bf16x3: an E2M1 value times a power of two has at most two significant bits, so w is exact in
    bfloat16, and a is exactly hi + mid + lo, three bfloat16 values (8 significant bits each, the
    remainders exact in float32): three bf16 products whose every term is exact in the fp32
    accumulator, at twice TF32's rate, with all 24 bits of a where tf32x3 keeps about 22. OPERAND
    is bfloat16 on the GPU; float32 under Triton's interpreter, which multiplies bfloat16 bit
    patterns as integers: the same parts and products there. The block's products are summed apart
    and added to acc in float32: the tensor cores truncate what they add to an accumulator, and
    summing into the running total lost a part in 10^5 over a row of 2,880 values (as tf32x3 does
    in Triton: its small products start from zero)."""
    if PRECISION == "bf16x3":
        hi = _bf16_part(a)
        rest = a - hi
        mid = _bf16_part(rest)
        lo = rest - mid
        wt = tl.trans(w.to(OPERAND))
        part = tl.dot(lo.to(OPERAND), wt, tl.zeros(acc.shape, tl.float32))
        part = tl.dot(mid.to(OPERAND), wt, part)
        acc += tl.dot(hi.to(OPERAND), wt, part)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _matrix_kernel(x_ptr, tok_ptr, pool_ptr, block_ptr, tiles_ptr, experts, out_ptr, role_off, row_bytes, col0,
                   out_width, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """out[r, col0 + n] = W[n] . x[tok[r]] for the sorted pair rows r of a tile, W the role's [N, K]
    matrix in the block of the tile's expert (gate: col0 = 0, up: col0 = F, rows of out_width);
    grid (tiles, N/BN)."""
    rank, _, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), 0, experts, BM)
    if elsewhere:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    tok = tl.load(tok_ptr + r, mask=rm, other=0).to(tl.int64)
    rowp = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16) + role_off + n.to(tl.int64)[:, None] * row_bytes
    j = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for b in range(0, K // BK):  # rows of whole blocks
        w = mxfp4_block(rowp, b, nm[:, None])  # [BN, BK]
        a = tl.load(x_ptr + tok[:, None] * K + b * BK + j[None, :], mask=rm[:, None], other=0.0)
        acc = _dot(a, w, acc, PRECISION, OPERAND)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * out_width + col0 + n[None, :], acc, mask=rm[:, None] & nm[None, :])


@triton.jit
def _down_kernel(gu_ptr, tiles_ptr, experts, pair_ptr, wt_ptr, out_ptr, pool_ptr, block_ptr, gate_b, up_b, down_off,
                 down_rb, down_b, D, F, limit, alpha, beta, linear_beta, ACT: tl.constexpr,
                 GU_BIAS: tl.constexpr, DOWN_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """out[pair[r], n] = weight[pair[r]] * (down[n] . act(gate[r] + bg, up[r] + bu) + bd[n]) for the
    sorted rows r of a tile, the activation applied as each block of gu is read; grid (tiles, D/BN)."""
    rank, _, r, rm, elsewhere = tile_at(tiles_ptr, tl.program_id(0), 0, experts, BM)
    if elsewhere:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    block = pool_ptr + tl.multiple_of(tl.load(block_ptr + rank), 16)
    drow = block + down_off + n.to(tl.int64)[:, None] * down_rb
    g_row = gu_ptr + r.to(tl.int64)[:, None] * (2 * F)
    j = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for b in range(0, F // BK):
        k = b * BK + j
        g = tl.load(g_row + k[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(g_row + F + k[None, :], mask=rm[:, None], other=0.0)
        if GU_BIAS:
            g += tl.load((block + gate_b).to(tl.pointer_type(tl.float32)) + k)[None, :]
            u += tl.load((block + up_b).to(tl.pointer_type(tl.float32)) + k)[None, :]
        a = tl.where(rm[:, None], _act(g, u, limit, alpha, beta, linear_beta, ACT), 0.0)
        w = mxfp4_block(drow, b, nm[:, None])
        acc = _dot(a, w, acc, PRECISION, OPERAND)
    if DOWN_BIAS:
        acc += tl.load((block + down_b).to(tl.pointer_type(tl.float32)) + n, mask=nm, other=0.0)[None, :]
    pair = tl.load(pair_ptr + r, mask=rm, other=0)
    acc = acc * tl.load(wt_ptr + pair, mask=rm, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc, mask=rm[:, None] & nm[None, :])


def decodes(roles: ExpertRoles) -> bool:
    """Whether every matrix of the experts is MXFP4 (gpt-oss, DeepSeek-V4): the experts whose
    prompts it runs."""
    return all(r.ggml_type == MXFP4 for r in (roles.gate, roles.up, roles.down))


def experts_grouped(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                    roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, n_expert: int | None = None) -> torch.Tensor:
    """moe_tiles.experts_in_tiles's contract (arguments, result, no host sync), for MXFP4 experts;
    tiles of BM pairs x BN rows, or BM_WIDE x BN_WIDE from WIDE_PAIRS pairs per routed expert."""
    total = offsets.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    out = torch.empty((total, d), dtype=torch.float32, device=x.device) if out is None else out
    wide = bool(n_expert) and total >= WIDE_PAIRS * n_expert  # by the step's shape: every wave alike
    bm, bn, precision = (BM_WIDE, BN_WIDE, PRECISION_WIDE) if wide else (BM, BN, PRECISION)
    t = expert_tiles(offsets, pairs, total // x.shape[0], pool.numel(), roles, bm, n_expert)
    n_tiles = t.table.shape[0]
    operand = tl.bfloat16 if x.is_cuda else tl.float32
    gu = torch.empty((t.order.shape[0], 2 * f), dtype=torch.float32, device=x.device)
    for role, col0 in ((roles.gate, 0), (roles.up, f)):
        _matrix_kernel[(n_tiles, triton.cdiv(f, bn))](
            x, t.tokens, pool, t.blocks, t.table, t.max_experts, gu, role.offset, role.row_bytes, col0, 2 * f, f, k,
            BM=bm, BN=bn, BK=BK, PRECISION=precision, OPERAND=operand, num_warps=WARPS)
    _down_kernel[(n_tiles, triton.cdiv(d, bn))](
        gu, t.table, t.max_experts, t.order, weights, out, pool, t.blocks, roles.gate_bias or 0, roles.up_bias or 0,
        roles.down.offset, roles.down.row_bytes, roles.down_bias or 0, d, f, act.limit, act.alpha, act.beta,
        act.linear_beta, ACT=int(act.kind), GU_BIAS=roles.gate_bias is not None,
        DOWN_BIAS=roles.down_bias is not None, BM=bm, BN=bn, BK=BK, PRECISION=precision, OPERAND=operand, num_warps=WARPS)
    return out
