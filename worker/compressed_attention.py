"""DeepSeek-V4's attention: one shared key/value head (K = V), a LoRA query normalized per head, a
per-head sink logit in the softmax, interleaved RoPE on the trailing `rope_dim` channels (undone
on the output, since V carried it), a grouped low-rank output projection; and per layer one of
three key sets:

- sliding window: the last `window` raw entries;
- HCA (ratio 128): plus one compressed entry per complete window of `ratio` tokens, a
  softmax-gated pool (with a learned per-slot bias) normalized and roped at the window's start;
- CSA (ratio 4): compressed entries from overlapping windows (entry w pools the first series of
  window w-1 with the second of window w), of which a lightning indexer (its own compressor, its
  own queries, ReLU scores weighted per head) picks the top `index_topk` for each query.

A query at position p sees compressed entry w only once its window is complete: w < (p+1)//ratio.
The caches grow across prefill and decode exactly as one long pass would see them: raw entries
(the last window - 1), per compressor the tokens of an incomplete window, the last window's first
series (CSA's overlap) and the entries emitted so far."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers import Rope, rms_norm
from .weights import head_linear, linear


@dataclass
class CompressorState:
    buf_kv: torch.Tensor | None = None  # projections of tokens of the incomplete window
    buf_gate: torch.Tensor | None = None
    overlap: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: the last window's first series
    entries: torch.Tensor | None = None  # [n, d], normalized and roped
    count: int = 0


@dataclass
class LayerState:
    raw: torch.Tensor | None = None  # [S, d]: the last window - 1 raw (roped) entries
    compressors: dict[str, CompressorState] = field(default_factory=dict)
    # Positions whose last indexer pick was a tie (the k-th and the next score equal, often both
    # exactly 0 after ReLU): which entry joins there is a convention, not arithmetic.
    indexer_ties: list[int] = field(default_factory=list)


def rope_tail(x: torch.Tensor, rope: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last rope.dim channels of x [T, H, d]."""
    nope, tail = x[..., :-rope.dim], x[..., -rope.dim:]
    return torch.cat([nope, rope.apply(tail, cos, sin)], dim=-1)


def compress(state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
             norm: torch.Tensor, ratio: int, overlap: bool, rope: Rope, eps: float) -> torch.Tensor:
    """Adds the new tokens' projections (kv, gate [T, c*d]) and returns every entry so far [n, d]."""
    first = state.count * ratio
    if state.buf_kv is not None:
        kv, gate = torch.cat([state.buf_kv, kv]), torch.cat([state.buf_gate, gate])
    usable = kv.shape[0] // ratio * ratio
    state.buf_kv, state.buf_gate = kv[usable:], gate[usable:]
    d = norm.shape[0]
    if usable:
        n = usable // ratio
        ckv = kv[:usable].view(n, ratio, -1)
        cgate = gate[:usable].view(n, ratio, -1) + ape
        if overlap:
            pool_kv = ckv.new_zeros((n, 2 * ratio, d))
            pool_gate = cgate.new_full((n, 2 * ratio, d), float("-inf"))
            pool_kv[:, ratio:], pool_gate[:, ratio:] = ckv[..., d:], cgate[..., d:]
            pool_kv[1:, :ratio], pool_gate[1:, :ratio] = ckv[:-1, :, :d], cgate[:-1, :, :d]
            if state.overlap is not None:
                pool_kv[0, :ratio], pool_gate[0, :ratio] = state.overlap
            state.overlap = (ckv[-1, :, :d].clone(), cgate[-1, :, :d].clone())
            ckv, cgate = pool_kv, pool_gate
        pooled = rms_norm((ckv * torch.softmax(cgate, dim=1)).sum(dim=1), norm, eps)  # [n, d]
        cos, sin = rope.cos_sin(torch.arange(n) * ratio + first, pooled.device)
        pooled = rope_tail(pooled[:, None, :], rope, cos, sin)[:, 0, :]
        state.entries = pooled if state.entries is None else torch.cat([state.entries, pooled])
        state.count += n
    if state.entries is None:
        state.entries = kv.new_zeros((0, d))
    return state.entries


@dataclass(frozen=True)
class AttentionShape:
    n_head: int
    head_dim: int
    window: int
    ratio: int  # 0: sliding window only
    o_groups: int
    index_heads: int
    index_dim: int
    index_topk: int
    eps: float


def attention(w: dict, p: str, x: torch.Tensor, tokens_start: int, state: LayerState, shape: AttentionShape,
              rope: Rope) -> torch.Tensor:
    """x [T, D] (the block's normalized input) at positions tokens_start.. -> [T, D]."""
    t, h, d = x.shape[0], shape.n_head, shape.head_dim
    positions = torch.arange(tokens_start, tokens_start + t)
    cos, sin = rope.cos_sin(positions, x.device)
    qr = rms_norm(linear(x, w[p + "attn_q_a.weight"]), w[p + "attn_q_a_norm.weight"].dequant(), shape.eps)
    q = rms_norm(linear(qr, w[p + "attn_q_b.weight"]).view(t, h, d), None, shape.eps)
    q = rope_tail(q, rope, cos, sin)
    kv = rms_norm(linear(x, w[p + "attn_kv.weight"]), w[p + "attn_kv_a_norm.weight"].dequant(), shape.eps)
    kv = rope_tail(kv[:, None, :], rope, cos, sin)[:, 0, :]  # [T, d]

    raw = kv if state.raw is None else torch.cat([state.raw, kv])
    raw_start = tokens_start + t - raw.shape[0]
    qpos = positions.to(x.device)[:, None]
    kpos = torch.arange(raw_start, raw_start + raw.shape[0], device=x.device)[None, :]
    visible = (kpos <= qpos) & (qpos - kpos < shape.window)  # [T, S]
    keys = raw
    if shape.ratio:
        entries = _compressed(w, p, x, qr, positions, state, shape, rope)
        threshold = (qpos + 1) // shape.ratio  # entries a query may see
        seen = torch.arange(entries.shape[0], device=x.device)[None, :] < threshold
        if p + "indexer.attn_q_b.weight" in w:
            seen &= _indexer_picks(w, p, x, qr, positions, state, shape, rope, threshold)
        keys = torch.cat([raw, entries])
        visible = torch.cat([visible, seen], dim=1)
    state.raw = raw[-(shape.window - 1):] if shape.window > 1 else raw[:0]

    scores = torch.einsum("thd,sd->hts", q, keys) * d ** -0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    sinks = w[p + "attn_sinks.weight"].dequant().reshape(h, 1, 1).expand(h, t, 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hts,sd->thd", probs, keys)
    out = rope_tail(out, rope, cos, -sin)  # V carried the rotation: undo it at the query's position

    grouped = head_linear(out.reshape(t, shape.o_groups, -1), w[p + "attn_output_a.weight"])  # [T, g, o_lora]
    return linear(grouped.reshape(t, -1), w[p + "attn_output_b.weight"])


def _compressed(w: dict, p: str, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, state: LayerState,
                shape: AttentionShape, rope: Rope) -> torch.Tensor:
    c = state.compressors.setdefault("attn", CompressorState())
    return compress(c, linear(x, w[p + "attn_compressor_kv.weight"]), linear(x, w[p + "attn_compressor_gate.weight"]),
                    w[p + "attn_compressor_ape.weight"].dequant(), w[p + "attn_compressor_norm.weight"].dequant(),
                    shape.ratio, _overlapping(w, p), rope, shape.eps)


def _overlapping(w: dict, p: str) -> bool:
    """CSA's compressor projects to two series (2 * d); HCA's to one."""
    return w[p + "attn_compressor_kv.weight"].shape[1] == 2 * w[p + "attn_compressor_norm.weight"].shape[0]


def _indexer_picks(w: dict, p: str, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, state: LayerState,
                   shape: AttentionShape, rope: Rope, threshold: torch.Tensor) -> torch.Tensor:
    """[T, n_entries] bool: the entries the lightning indexer picks for each query."""
    c = state.compressors.setdefault("indexer", CompressorState())
    keys = compress(c, linear(x, w[p + "indexer_compressor_kv.weight"]),
                    linear(x, w[p + "indexer_compressor_gate.weight"]),
                    w[p + "indexer_compressor_ape.weight"].dequant(), w[p + "indexer_compressor_norm.weight"].dequant(),
                    shape.ratio, True, rope, shape.eps)
    t, n = x.shape[0], keys.shape[0]
    picked = torch.zeros((t, n), dtype=torch.bool, device=x.device)
    if n == 0:
        return picked
    cos, sin = rope.cos_sin(positions, x.device)
    q = rope_tail(linear(qr, w[p + "indexer.attn_q_b.weight"]).view(t, shape.index_heads, shape.index_dim),
                  rope, cos, sin)
    scores = torch.relu(torch.einsum("thd,sd->ths", q, keys)) * shape.index_dim ** -0.5
    weights = linear(x, w[p + "indexer.proj.weight"]) * shape.index_heads ** -0.5  # [T, heads]
    index = (scores * weights[..., None]).sum(dim=1)  # [T, n]
    future = torch.arange(n, device=x.device)[None, :] >= threshold
    # torch.topk, as transformers picks. Entries often tie (ReLU makes many scores exactly 0) and
    # topk leaves ties unspecified: a tie at the last pick may go either way on another device or
    # tensor shape (prefill vs decode). Those positions are recorded.
    k = min(shape.index_topk, n)
    masked = index.masked_fill(future, float("-inf"))
    top = masked.topk(k, dim=-1).indices
    picked.scatter_(1, top, True)
    if k < n:
        last = masked.gather(1, top).min(dim=-1).values
        next_best = masked.masked_fill(picked, float("-inf")).max(dim=-1).values
        tie = (last == next_best) & (next_best > float("-inf"))
        state.indexer_ties.extend(positions[tie.cpu()].tolist())
    return picked & ~future
