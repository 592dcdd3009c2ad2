"""The math a layer asks of its device, chosen once per device when a model loads (backend.ops_for).

TorchOps is the reference: plain torch on any device, what CI runs and what the kernels are checked
against. TritonOps (triton_ops.py) runs the same products through the Triton kernels, which decode
quantized bytes in registers, and takes TorchOps' formula where its kernels do not cover a shape.
A model's layers hold the ops of their device and call them; nothing on the way from a request to
the logits asks again which device it is on or imports a kernel."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from ..weights.qtensor import QTensor
from . import hyper_connections, layers, routing
from .layers import Rope


@dataclass
class AheadSlots:
    """A layer's guessed experts, whose kept RAM-tier blocks a table step copies ahead of it
    (ops.expert_ahead), for its lookup (ops.expert_lookup): device tensors a CUDA graph reads and
    writes in place. Both find which guesses are kept from the layer's table row, alike."""
    guess: torch.Tensor  # [k] int64: the guessed experts, the router's likeliest first; g's block goes to ahead slot g
    base: int  # byte offset of ahead slot 0 from the pool
    counts: torch.Tensor  # [3] int64, added to: kept pairs looked up, of those read ahead, blocks copied ahead
    most: int  # kept guesses copied ahead: the first `most` of them, in the guess's order


def _kept_guesses(row: torch.Tensor, ahead: AheadSlots, resident_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The guesses clamped into the row, and which of them are copied ahead: kept blocks, the
    first ahead.most of them."""
    guess = ahead.guess.reshape(-1).clamp(0, row.shape[0] - 1)
    at = row[guess]
    kept = ((at != -1) & ((at < 0) | (at >= resident_bytes))).to(torch.int64)
    return guess, (kept > 0) & (torch.cumsum(kept, 0) - kept < ahead.most)


def _read_kept(pool: torch.Tensor, at: int, dst: int, nbytes: int) -> None:
    """A kept block (host memory at pool's address + `at`) into the pool at `dst`: the CPU's read."""
    if pool.device.type != "cpu":
        raise RuntimeError("TorchOps reads kept RAM-tier blocks on the CPU only; the GPU's are TritonOps'")
    block = (ctypes.c_uint8 * nbytes).from_address(pool.data_ptr() + at)
    pool[dst:dst + nbytes].copy_(torch.frombuffer(block, dtype=torch.uint8))


class TorchOps:
    """Every op in torch: a quantized matrix is dequantized for its one use."""

    kernels = False  # whether this device runs the fused kernels (the engine's CUDA graphs, the fused MoE)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # -- quantized matrices
    def linear(self, x: torch.Tensor, w: QTensor, bias: QTensor | None = None) -> torch.Tensor:
        """x [..., in] @ w^T -> [..., out], with float32 accumulation."""
        y = x @ self.dequant(w, x.dtype).T
        return y if bias is None else y + bias.dequant(x.dtype)

    def linear_parts(self, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        """x [T, in] @ w^T for a consumer that adds partial sums itself (add_rms_norm, the q/k/v
        RoPE kernel, the routers): [T, S, out] where the kernels split K, else [T, out], the sum."""
        return self.linear(x, w)

    def head_linear(self, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        """x [T, H, K] times a matrix per head, w holding H matrices [R, K] one after another (ggml
        shape (K, R, H), or (K, H * R)) -> [T, H, R]: MLA's absorbed projections, DeepSeek-V4's
        grouped output."""
        t, h, k = x.shape
        r = math.prod(w.shape[1:]) // h
        return torch.einsum("thk,hrk->thr", x, self.dequant(w, x.dtype).view(h, r, k))

    def dequant(self, w: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w's values in torch order (a matrix ne [in, out] -> [out, in])."""
        return w.dequant(dtype)

    def rows(self, w: QTensor, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of a matrix (an embedding lookup) without dequantizing the whole table."""
        return w.rows(ids, dtype)

    def output_logits(self, h: torch.Tensor, head: QTensor, last: int | torch.Tensor) -> torch.Tensor:
        """The output head over every position, or over the last `last` rows only (True: one) where
        nothing else reads the prompt's logits (a generation's prefill), or over the rows a tensor
        `last` names (a mixed step's pieces' last rows and next tokens, Engine.mixed_step): the
        head is a step's largest matrix, and a long prompt's logits are its largest product."""
        if isinstance(last, torch.Tensor):
            return self.linear(h.index_select(0, last), head)
        return self.linear(h[-int(last):] if last else h, head)

    # -- pointwise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return layers.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after a block, x + delta, and the next block's input, its RMSNorm.
        delta [T, D], or [T, n, D] (the per-slot outputs of the experts, added over n first)."""
        x = x + (delta.sum(dim=1) if delta.dim() == 3 else delta)
        return x, self.rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, d]: its first rope.dim channels rotated (cos/sin [T, dim/2])."""
        return rope.apply(x, cos, sin)

    def rope_tail(self, x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
                  ) -> torch.Tensor:
        """x [T, H, d]: its last rope.dim channels rotated (DeepSeek-V4's layout), or the rotation
        undone where `inverse`."""
        nope, tail = x[..., :-rope.dim], x[..., -rope.dim:]
        return torch.cat([nope, rope.apply(tail, cos, -sin if inverse else sin)], dim=-1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, scale: float,
                  window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """layers.attention: causal attention of q [T, H, d] at positions start.. (or [T] given) over
        k [S, Hkv, d], v [S, Hkv, dv] -> [T, H, dv]."""
        return layers.attention(q, k, v, start, scale, window, sinks)

    def shared_head_attention(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
                              sinks: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's: q [T, H, d] over one key head that is also the value head, keys [S, d],
        where visible [T, S] (keys in any order), with a sink logit per head [H] -> [T, H, d]."""
        t, h = q.shape[0], q.shape[1]
        scores = torch.einsum("thd,sd->hts", q, keys) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(torch.cat([scores, sinks.reshape(h, 1, 1).expand(h, t, 1)], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hts,sd->thd", probs, keys)

    # -- routing: router logits [T, E] (or linear_parts' [T, S, E]) -> expert ids [T, k], weights [T, k]
    def softmax_topk(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.softmax_topk(logits, k, normalize)

    def topk_softmax(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.topk_softmax(logits, k)

    def sqrtsoftplus_topk(self, logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.sqrtsoftplus_topk(logits, bias, k, scale)

    def sqrtsoftplus_hashed(self, logits: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.sqrtsoftplus_hashed(logits, table, tokens, scale)

    # -- the expert cache's device table (engine.TableDecode)
    def expert_lookup(self, ids: torch.Tensor, row: torch.Tensor, rec_ids: torch.Tensor, rec_offsets: torch.Tensor,
                      pool: torch.Tensor, resident_bytes: int, slot_bytes: int, nbytes: int,
                      ahead: AheadSlots | None = None) -> torch.Tensor:
        """Where a step's experts `ids` [T, k] sit: `row` [E] holds each expert's byte offset from
        `pool`: in its resident slots [0, resident_bytes), -1 where absent, anywhere else for a block
        the cache keeps in expertd's RAM tier (host memory the device reads at its address). Records
        the ids (clamped into the row: past an absent expert the routing may read NaN) and their
        offsets into `rec_ids`, `rec_offsets` [T*k]; copies each kept block's `nbytes` into its
        pair's transit slot (pair p's at resident_bytes + p * slot_bytes) and returns the offsets
        the kernels read: resident ones as they are, kept ones their transit slot's, absent ones 0
        (a pass the host will drop reads only the cache). With `ahead` (one token's k, whose guessed
        kept blocks expert_ahead copied), a kept block found there is read from its ahead slot and
        not copied again; ahead.counts gains the kept pairs, those, and the blocks copied ahead.
        Here on the CPU only: kept blocks are read at their address (the Triton kernel, TritonOps,
        does it on the GPU)."""
        inside = ids.reshape(-1).clamp(0, row.shape[0] - 1)
        rec_ids.copy_(inside)
        torch.index_select(row, 0, inside, out=rec_offsets)
        at = rec_offsets
        transit = resident_bytes + torch.arange(at.numel(), dtype=torch.int64, device=at.device) * slot_bytes
        resident = (at >= 0) & (at < resident_bytes)
        kept = ~resident & (at != -1)
        offsets = torch.where(resident, at, torch.where(kept, transit, 0))
        if ahead is not None:
            guess, copied = _kept_guesses(row, ahead, resident_bytes)
            match = (inside[:, None] == guess[None, :]) & copied[None, :] & kept[:, None]
            found = match.any(dim=1)
            offsets = torch.where(found, ahead.base + match.to(torch.int64).argmax(dim=1) * slot_bytes, offsets)
            ahead.counts += torch.stack([kept.sum(), found.sum(), copied.sum()])
            kept = kept & ~found
        for p in kept.nonzero().reshape(-1).tolist():
            _read_kept(pool, int(at[p]), int(transit[p]), nbytes)
        return offsets

    def expert_ahead(self, row: torch.Tensor, ahead: AheadSlots, pool: torch.Tensor, resident_bytes: int,
                     slot_bytes: int, nbytes: int) -> None:
        """The guessed experts ahead.guess [k] of the next layer (its router on this layer's router
        input, lookahead.guess) that the cache keeps in the RAM tier (`row`, as expert_lookup reads
        it), the likeliest ahead.most of them: each block into its ahead slot (guess g's at
        ahead.base + g * slot_bytes). On the GPU this runs on a side stream while the layer
        computes, so the next layer's lookup finds the right guesses in VRAM; a wrong guess costs
        PCIe time only: what a layer reads is what its own routing picks."""
        guess, copied = _kept_guesses(row, ahead, resident_bytes)
        for g in copied.nonzero().reshape(-1).tolist():
            _read_kept(pool, int(row[guess[g]]), ahead.base + g * slot_bytes, nbytes)

    # -- DeepSeek-V4's hyper-connections (hyper_connections.py)
    def hc_weights(self, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper_connections.sinkhorn_weights(mixes, base, scale, n, iters, eps)

    def hc_collapse_norm(self, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> torch.Tensor:
        return hyper_connections.collapse_norm(streams, pre, weight, eps)

    def hc_expand(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                  ) -> torch.Tensor:
        return hyper_connections.expand(streams, out, post, comb)
