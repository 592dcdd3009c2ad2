"""TorchOps through the Triton kernels: a quantized matrix is decoded in registers where it is
multiplied (kernels/linear_tl.py), pointwise chains are one launch each, and a decode step's
attention, routing and experts are fused kernels. Where a kernel does not cover a shape (many
queries, another dtype, a 1-D weight) the
reference formula runs, on the same device. Imported once, by ops.ops_for, when a model loads onto
a device that runs the kernels."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
from gguf import GGMLQuantizationType as T

from ..kernels import hyper_tl, linear_tl, moe_grouped, moe_integer
from ..kernels.attention_tl import decode_attention
from ..kernels.compress_tl import compress_step, step_visible
from ..kernels.host_rows_tl import host_rows
from ..kernels.iq_dot_tl import IQ_DOT_TYPES
from ..kernels.linear_tl import dequantize, matmul, matvec_heads, matvec_parts
from ..kernels.moe_dense import experts_dense
from ..kernels.moe_tiles import experts_in_tiles
from ..kernels.moe_tl import experts_per_pair
from ..kernels.pointwise_tl import add_rms_norm, qkv_rope_store, rms_norm, rope
from ..kernels.routing_tl import expert_ahead, expert_lookup, softmax_topk, sqrtsoftplus_route
from ..weights.expert_roles import ExpertRoles
from ..weights.qtensor import QTensor
from .layers import DECODE_MAX_QUERIES, Rope, RopeStyle
from .ops import AheadSlots, TorchOps


class TritonOps(TorchOps):
    kernels = True

    # -- quantized matrices: every type a model may load (weights.quant.check_supported) has a decoder in the kernels
    def linear(self, x: torch.Tensor, w: QTensor, bias: QTensor | None = None) -> torch.Tensor:
        k, n = w.shape[0], math.prod(w.shape[1:])
        y = matmul(x.reshape(-1, k).to(torch.float32).contiguous(), w.raw, w.kernel_type, k, n)
        y = y.reshape(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias.dequant()
        return y.to(x.dtype)

    def linear_parts(self, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= linear_tl.MATVEC_MAX_ROWS:
            k, n = w.shape[0], math.prod(w.shape[1:])
            return matvec_parts(x.to(torch.float32).contiguous(), w.raw, w.kernel_type, k, n)
        return self.linear(x, w)

    def head_linear(self, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        t, h, k = x.shape
        if t <= linear_tl.MATVEC_MAX_ROWS:
            return matvec_heads(x.to(torch.float32), w.raw, w.kernel_type, k, math.prod(w.shape[1:]) // h).to(x.dtype)
        return super().head_linear(x, w)

    def dequant(self, w: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One launch, and nothing a CUDA graph cannot capture; an aligned float32 matrix is a view
        of its bytes (read-only, as every caller uses it)."""
        if len(w.shape) == 1:
            return w.dequant(dtype)
        if w.ggml_type is T.F32 and w.raw.data_ptr() % 4 == 0:
            values = w.raw.view(torch.float32).reshape(tuple(reversed(w.shape)))
        else:
            values = dequantize(w.raw, w.kernel_type, w.shape[0], math.prod(w.shape[1:]))
            values = values.reshape(tuple(reversed(w.shape)))
        return values if dtype is torch.float32 else values.to(dtype)

    def rows(self, w: QTensor, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """From VRAM, or from pinned host memory where the table lives there (the token embedding on
        GPUs: Placement.weights), read in place by the GPU."""
        row_bytes = w.raw.numel() // w.shape[1]
        table = w.raw.reshape(w.shape[1], row_bytes)
        picked = table[ids.reshape(-1)] if table.device == ids.device else host_rows(table, ids.reshape(-1))
        out = dequantize(picked, w.kernel_type, w.shape[0], picked.shape[0])
        return out.reshape(*ids.shape, w.shape[0]).to(dtype)

    # -- pointwise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
            return rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dim() == 2 and x.dtype == delta.dtype == torch.float32
                and (weight is None or weight.dtype == torch.float32)):
            return add_rms_norm(x, delta, weight, eps)
        return super().add_rms_norm(x, delta, weight, eps)

    def rope(self, x: torch.Tensor, rope_: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 3 and cos.shape[0] == x.shape[0]:
            return rope(x, cos, sin, rope_.dim, rope_.style is RopeStyle.NEOX)
        return super().rope(x, rope_, cos, sin)

    def rope_tail(self, x: torch.Tensor, rope_: Rope, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
                  ) -> torch.Tensor:
        if x.dtype == torch.float32 and cos.shape[0] == x.shape[0]:
            return rope(x, cos, sin, rope_.dim, rope_.style is RopeStyle.NEOX, x.shape[-1] - rope_.dim, inverse)
        return super().rope_tail(x, rope_, cos, sin, inverse)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, scale: float,
                  window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] <= DECODE_MAX_QUERIES and q.dtype == k.dtype == v.dtype == torch.float32:
            t = q.shape[0]
            positions = start if isinstance(start, torch.Tensor) else torch.arange(start, start + t, device=q.device)
            return decode_attention(q, k, v, positions, scale, window, sinks)
        return super().attention(q, k, v, start, scale, window, sinks)

    def shared_head_attention(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
                              sinks: torch.Tensor) -> torch.Tensor:
        if q.shape[0] == 1:  # a decode step: one launch over the keys it sees
            return decode_attention(q, keys[:, None], keys[:, None], None, scale, sinks=sinks, visible=visible)
        return super().shared_head_attention(q, keys, visible, scale, sinks)

    # -- routing
    def softmax_topk(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, k, normalize)

    def topk_softmax(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, k, normalize=False, softmax_first=False)

    def sqrtsoftplus_topk(self, logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        return sqrtsoftplus_route(logits, k, scale, bias=bias)

    def sqrtsoftplus_hashed(self, logits: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return sqrtsoftplus_route(logits, table.shape[1], scale, table=table, tokens=tokens)

    def expert_lookup(self, ids: torch.Tensor, row: torch.Tensor, rec_ids: torch.Tensor, rec_offsets: torch.Tensor,
                      pool: torch.Tensor, resident_bytes: int, slot_bytes: int, nbytes: int,
                      ahead: AheadSlots | None = None) -> torch.Tensor:
        return expert_lookup(ids, row, rec_ids, rec_offsets, pool, resident_bytes, slot_bytes, nbytes, ahead)

    def expert_ahead(self, row: torch.Tensor, ahead: AheadSlots, pool: torch.Tensor, resident_bytes: int,
                     slot_bytes: int, nbytes: int) -> None:
        expert_ahead(row, ahead, pool, resident_bytes, slot_bytes, nbytes)

    # -- DeepSeek-V4's hyper-connections
    def hc_weights(self, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper_tl.hc_weights(mixes, base, scale, n, iters, eps)

    def hc_collapse_norm(self, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> torch.Tensor:
        if streams.dtype == torch.float32:
            return hyper_tl.collapse_norm(streams, pre, weight.float(), eps)
        return super().hc_collapse_norm(streams, pre, weight, eps)

    def hc_expand(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                  ) -> torch.Tensor:
        if streams.dtype == out.dtype == torch.float32:
            return hyper_tl.expand(streams, out, post, comb)
        return super().hc_expand(streams, out, post, comb)

    # -- what only the kernels have: blocks whose fused form is another algorithm (callers ask ops.kernels)
    qkv_rope_store = staticmethod(qkv_rope_store)  # q/k/v's norms, RoPE and the cache write in one launch
    step_visible = staticmethod(step_visible)  # DeepSeek-V4: the keys a decode step sees
    compress_step = staticmethod(compress_step)  # DeepSeek-V4: a compressor's decode step in two launches

    @staticmethod
    def experts_runner(path: str, n_expert: int) -> Callable[..., torch.Tensor]:
        """The fused MoE kernels of moe.fused_path's `path`."""
        return {"grouped": partial(moe_grouped.experts_grouped, n_expert=n_expert),
                "dense": partial(experts_dense, n_expert=n_expert),
                "integer": partial(moe_integer.experts_integer, n_expert=n_expert),
                "integer_tiles": partial(moe_integer.experts_integer_tiles, n_expert=n_expert),
                "tiles": partial(experts_in_tiles, n_expert=n_expert), "per_pair": experts_per_pair}[path]

    @staticmethod
    def experts_grouped(roles: ExpertRoles) -> bool:
        """Whether these experts run on the tensor-core kernels (moe_grouped: MXFP4)."""
        return moe_grouped.decodes(roles)

    @staticmethod
    def experts_integer(roles: ExpertRoles) -> bool:
        """Whether a long prompt's experts run as float16 products of their quants (moe_integer: Q4_K)."""
        return moe_integer.runs(roles)

    @staticmethod
    def experts_tiled(roles: ExpertRoles) -> bool:
        """Whether a few pairs an expert run faster in moe_tiles than per pair: not where a matrix is
        an i-quant, which moe_tiles decodes through dequant_tl's [BN, 256] values and moe_tl through
        iq_dot (on the H200, a 32-token prompt of the 12-layer Qwen3-30B-A3B at IQ2_XXS: 997 tok/s
        in tiles, 3,275 per pair)."""
        return not any(int(r.ggml_type) in IQ_DOT_TYPES for r in (roles.gate, roles.up, roles.down))
