"""Every expert a layer selected, in two launches (three where the down matrix is an i-quant, whose
products read the activations from memory: iq_dot_tl), read through a byte-offset map: `offsets[p]`
is where the block of pair p's expert starts in `pool` (the resident table or the cache's slots), p
indexing the [T, k] routing flattened. The first launch computes gate and up (or a fused gate_up)
from the GGUF bytes, K split across programs where a decode step has few pairs; the second sums the
splits, adds the biases, applies the activation as it reads them, then the down projection, its bias
and the routing weight, into one row per pair, which the caller sums over k in a fixed order. A
pair's result depends on its expert's bytes and its token only, never on where the block sits or
which other pairs run: a cache of any size gives the very bits of the resident table. `pairs`
restricts a launch to some pairs (a cache that loads a step's experts in waves)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..nn.activation import Activation
from ..weights.expert_roles import ExpertRoles
from ..weights.quant_iq import kernel_tables
from .dequant_tl import CHUNK, MXFP4, Q8_0, block_dot, chunk
from .iq_dot_tl import IQ_DOT_TYPES, iq_dot, takes_iq_dot

BN = 16  # rows of an expert's matrix per program
WARPS = 4
ACT_BLOCK = 1024  # activations per program of _act_kernel
PROGRAMS_PER_SM = 32  # split gate/up's K until a decode step's pairs give this many programs per multiprocessor


@triton.jit
def _act(g, u, limit, alpha, beta, linear_beta, ACT: tl.constexpr):
    if ACT == 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        tl.static_assert(ACT == 2, "unknown activation")
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if linear_beta > 0:
            u = linear_beta * _tanh(u / linear_beta)
        a = a * u
    return a


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _pair(i, pair_ptr, HAS_PAIRS: tl.constexpr):
    """The pair program i runs: the i-th of `pairs` where given, else pair i."""
    if HAS_PAIRS:
        p = tl.load(pair_ptr + i).to(tl.int64)
    else:
        p = i.to(tl.int64)
    return p


@triton.jit
def _gate_up_kernel(x_ptr, pool_ptr, off_ptr, pair_ptr, gu_ptr, tab, gate_off, up_off, gate_rb, up_rb, F, K, k_top,
                    P, chunks_per_split, QG: tl.constexpr, QU: tl.constexpr, HAS_PAIRS: tl.constexpr,
                    BN: tl.constexpr, CH: tl.constexpr):
    """gu[s, p, 0, n] = gate[n] . x[t] and gu[s, p, 1, n] = up[n] . x[t] over the chunks of K that
    split s owns; grid (pairs, F/BN, splits): pairs on the axis that takes more than 65535 (a long
    prefill)."""
    pid_n, s = tl.program_id(1), tl.program_id(2)
    p = _pair(tl.program_id(0), pair_ptr, HAS_PAIRS)
    t = p // k_top
    base = pool_ptr + tl.multiple_of(tl.load(off_ptr + p), 16)  # blocks start 4096-aligned
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    rows = n.to(tl.int64)[:, None]
    grow = base + gate_off + rows * gate_rb
    urow = base + up_off + rows * up_rb
    acc_g = tl.zeros([BN], tl.float32)  # each chunk's products summed per row as decoded: fewer registers
    acc_u = tl.zeros([BN], tl.float32)
    for step in range(0, chunks_per_split):  # the last split's spare chunks are masked (k >= K)
        c = s * chunks_per_split + step
        k = c * CH + j
        m = (n < F)[:, None] & (k < K)[None, :]
        xv = tl.load(x_ptr + t * K + k, mask=k < K, other=0.0)[None, :]
        if QG == MXFP4 or QG == Q8_0:
            acc_g += block_dot(QG, grow, c, (n < F)[:, None], K, xv)
        elif takes_iq_dot(QG):
            acc_g += iq_dot(QG, grow, c, (n < F)[:, None], K, x_ptr + t * K + c * CH, tab)
        else:
            acc_g += tl.sum(chunk(QG, grow, c, j[None, :], m, tab) * xv, axis=1)
        if QU == MXFP4 or QU == Q8_0:
            acc_u += block_dot(QU, urow, c, (n < F)[:, None], K, xv)
        elif takes_iq_dot(QU):
            acc_u += iq_dot(QU, urow, c, (n < F)[:, None], K, x_ptr + t * K + c * CH, tab)
        else:
            acc_u += tl.sum(chunk(QU, urow, c, j[None, :], m, tab) * xv, axis=1)
    out = gu_ptr + ((s * P + p) * 2) * F + n
    tl.store(out, acc_g, mask=n < F)
    tl.store(out + F, acc_u, mask=n < F)


@triton.jit
def _activation(gu_ptr, base, p, k, F, P, gate_b, up_b, limit, alpha, beta, linear_beta, ACT: tl.constexpr,
                SPLITS: tl.constexpr, GU_BIAS: tl.constexpr):
    """act(gate, up) of pair p at positions k of F: gate and up summed over their splits (in split
    order) with their biases; zero past F."""
    g = tl.load(gu_ptr + p * 2 * F + k, mask=k < F, other=0.0)
    u = tl.load(gu_ptr + (p * 2 + 1) * F + k, mask=k < F, other=0.0)
    for s in tl.static_range(1, SPLITS):
        g += tl.load(gu_ptr + ((s * P + p) * 2) * F + k, mask=k < F, other=0.0)
        u += tl.load(gu_ptr + ((s * P + p) * 2 + 1) * F + k, mask=k < F, other=0.0)
    if GU_BIAS:
        g += tl.load((base + gate_b).to(tl.pointer_type(tl.float32)) + k, mask=k < F, other=0.0)
        u += tl.load((base + up_b).to(tl.pointer_type(tl.float32)) + k, mask=k < F, other=0.0)
    return tl.where(k < F, _act(g, u, limit, alpha, beta, linear_beta, ACT), 0.0)


@triton.jit
def _act_kernel(gu_ptr, pool_ptr, off_ptr, pair_ptr, av_ptr, gate_b, up_b, F, P, limit, alpha, beta, linear_beta,
                ACT: tl.constexpr, SPLITS: tl.constexpr, GU_BIAS: tl.constexpr, HAS_PAIRS: tl.constexpr,
                BF: tl.constexpr):
    """av[p] = act(gate, up) once per pair, for down matrices that read their input from memory
    (iq_dot); grid (pairs, F/BF)."""
    p = _pair(tl.program_id(0), pair_ptr, HAS_PAIRS)
    base = pool_ptr + tl.multiple_of(tl.load(off_ptr + p), 16)
    k = tl.program_id(1) * BF + tl.arange(0, BF)
    av = _activation(gu_ptr, base, p, k, F, P, gate_b, up_b, limit, alpha, beta, linear_beta, ACT, SPLITS, GU_BIAS)
    tl.store(av_ptr + p * F + k, av, mask=k < F)


@triton.jit
def _down_kernel(gu_ptr, pool_ptr, off_ptr, pair_ptr, w_ptr, y_ptr, av_ptr, tab, gate_b, up_b, down_off, down_rb,
                 down_b, D, F, P, limit, alpha, beta, linear_beta, QD: tl.constexpr, ACT: tl.constexpr,
                 SPLITS: tl.constexpr, GU_BIAS: tl.constexpr, DOWN_BIAS: tl.constexpr, HAS_PAIRS: tl.constexpr, BN: tl.constexpr,
                 CH: tl.constexpr):
    """y[p, n] = weight[p] * (down[n] . act(gate, up) + bias[n]), the activation applied as each
    chunk of F is read (an i-quant down matrix reads it from av, written by _act_kernel);
    grid (pairs, D/BN)."""
    p = _pair(tl.program_id(0), pair_ptr, HAS_PAIRS)
    base = pool_ptr + tl.multiple_of(tl.load(off_ptr + p), 16)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, CH)
    drow = base + down_off + n.to(tl.int64)[:, None] * down_rb
    acc = tl.zeros([BN], tl.float32)
    for c in range(0, tl.cdiv(F, CH)):
        k = c * CH + j
        if takes_iq_dot(QD):
            acc += iq_dot(QD, drow, c, (n < D)[:, None], F, av_ptr + p * F + c * CH, tab)
        else:
            av = _activation(gu_ptr, base, p, k, F, P, gate_b, up_b, limit, alpha, beta, linear_beta, ACT, SPLITS,
                             GU_BIAS)
            if QD == MXFP4 or QD == Q8_0:
                acc += block_dot(QD, drow, c, (n < D)[:, None], F, av[None, :])
            else:
                m = (n < D)[:, None] & (k < F)[None, :]
                acc += tl.sum(chunk(QD, drow, c, j[None, :], m, tab) * av[None, :], axis=1)
    y = acc
    if DOWN_BIAS:
        y += tl.load((base + down_b).to(tl.pointer_type(tl.float32)) + n, mask=n < D, other=0.0)
    tl.store(y_ptr + p * D + n, y * tl.load(w_ptr + p), mask=n < D)


def gate_up_splits(n_pairs: int, f: int, k: int, device: torch.device) -> int:
    """Split K so that a decode step's few pairs still give every multiprocessor several programs;
    a function of the shapes (all T*k pairs, not the ones a wave runs) and the GPU alone, so a
    cache of any size gives the bits of the resident table."""
    from .linear_tl import _sm_count

    programs = n_pairs * triton.cdiv(f, BN)
    chunks = triton.cdiv(k, CHUNK)
    splits = max(1, min(chunks, math.ceil(PROGRAMS_PER_SM * _sm_count(device) / programs)))
    return triton.cdiv(chunks, triton.cdiv(chunks, splits))  # no split left without chunks


def experts_per_pair(x: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                     roles: ExpertRoles, act: Activation, pairs: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32, offsets [T*k] int64 (bytes into pool, multiples of 16), weights [T*k]
    float32 -> out [T*k, D]: each pair's expert output times its routing weight (rows of pairs
    outside `pairs`, when given, are left as they were)."""
    total = offsets.shape[0]
    k_top = total // x.shape[0]
    n_pairs = total if pairs is None else pairs.shape[0]
    f, d, k = roles.gate.n, roles.down.n, roles.gate.k
    splits = gate_up_splits(total, f, k, x.device)
    per_split = triton.cdiv(triton.cdiv(k, CHUNK), splits)
    gu = torch.empty((splits, total, 2, f), dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty((total, d), dtype=torch.float32, device=x.device)
    pair_arg = pairs if pairs is not None else offsets  # unused when HAS_PAIRS is false
    _gate_up_kernel[(n_pairs, triton.cdiv(f, BN), splits)](
        x, pool, offsets, pair_arg, gu, kernel_tables(x.device), roles.gate.offset, roles.up.offset, roles.gate.row_bytes,
        roles.up.row_bytes, f, k, k_top, total, per_split,
        QG=roles.gate.ggml_type, QU=roles.up.ggml_type, HAS_PAIRS=pairs is not None, BN=BN, CH=CHUNK,
        num_warps=WARPS)
    av = gu  # unused unless the down matrix reads the activations from memory
    if int(roles.down.ggml_type) in IQ_DOT_TYPES:
        av = torch.empty((total, f), dtype=torch.float32, device=x.device)
        _act_kernel[(n_pairs, triton.cdiv(f, ACT_BLOCK))](
            gu, pool, offsets, pair_arg, av, roles.gate_bias or 0, roles.up_bias or 0, f, total, act.limit, act.alpha,
            act.beta, act.linear_beta, ACT=int(act.kind), SPLITS=splits, GU_BIAS=roles.gate_bias is not None,
            HAS_PAIRS=pairs is not None, BF=ACT_BLOCK, num_warps=WARPS)
    _down_kernel[(n_pairs, triton.cdiv(d, BN))](
        gu, pool, offsets, pair_arg, weights, out, av, kernel_tables(x.device), roles.gate_bias or 0, roles.up_bias or 0, roles.down.offset,
        roles.down.row_bytes, roles.down_bias or 0, d, f, total, act.limit, act.alpha, act.beta, act.linear_beta,
        QD=roles.down.ggml_type, ACT=int(act.kind), SPLITS=splits, GU_BIAS=roles.gate_bias is not None,
        DOWN_BIAS=roles.down_bias is not None,
        HAS_PAIRS=pairs is not None, BN=BN, CH=CHUNK, num_warps=WARPS)
    return out
