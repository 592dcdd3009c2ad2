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
series (CSA's overlap) and the entries emitted so far.

Once the KV cache is reserved (KVCache.reserve) the state moves into buffers of fixed shape
(StepBuffers), and a decode step at a device position (`attention` given a tensor) runs the same
operations at every position without a host sync: raw entries in a ring, the entries of every
window that can start within the capacity (rows not yet complete are masked), the incomplete
window's tokens at their offset in it, the indexer's top-k over the whole entry buffer with the
invalid entries at -inf. A compressed entry is written only when its window completes (a
torch.where, not a branch), so the buffers hold what reserving an eager state would write.

A layer's tensors arrive as AttentionWeights, resolved from their GGUF names once at load: the
functions here read roles, never names."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from ..weights.qtensor import QTensor
from .layers import Rope, RopeStyle

if TYPE_CHECKING:
    from .ops import TorchOps


@dataclass(frozen=True)
class CompressorWeights:
    """A compressor's tensors (`<prefix>_kv`, `_gate`, `_ape`, `_norm`): its two projections, a
    learned gate bias per slot of the window, its entries' norm."""
    kv: QTensor
    gate: QTensor
    ape: QTensor
    norm: QTensor

    @classmethod
    def load(cls, w: dict[str, QTensor], prefix: str) -> "CompressorWeights":
        return cls(*(w[f"{prefix}_{role}.weight"] for role in ("kv", "gate", "ape", "norm")))

    @property
    def overlapping(self) -> bool:
        """Whether it projects to two series (2 * d, CSA's) rather than one (HCA's)."""
        return self.kv.shape[1] == 2 * self.norm.shape[0]

    def inputs(self, ops: TorchOps, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Its projections of x (kv, gate [T, c*d]), its ape [ratio, c*d] and norm [d]."""
        return ops.linear(x, self.kv), ops.linear(x, self.gate), ops.dequant(self.ape), ops.dequant(self.norm)


@dataclass(frozen=True)
class IndexerWeights:
    """CSA's lightning indexer: its queries from the query's LoRA input, its per-head weights and
    its own compressor, whose entries it scores."""
    q_b: QTensor  # indexer.attn_q_b
    proj: QTensor  # indexer.proj
    compressor: CompressorWeights  # indexer_compressor_*

    @classmethod
    def load(cls, w: dict[str, QTensor], p: str) -> "IndexerWeights":
        return cls(w[p + "indexer.attn_q_b.weight"], w[p + "indexer.proj.weight"],
                   CompressorWeights.load(w, p + "indexer_compressor"))


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention tensors by role, resolved from their GGUF names once at load."""
    q_a: QTensor
    q_a_norm: QTensor
    q_b: QTensor
    kv: QTensor
    kv_norm: QTensor  # attn_kv_a_norm
    sinks: QTensor
    output_a: QTensor  # the grouped low-rank output: a matrix per group, then one over the groups
    output_b: QTensor
    compressor: CompressorWeights | None  # a compressed layer's (ratio > 0)
    indexer: IndexerWeights | None  # a compressed layer's where its GGUF has one (CSA)

    @classmethod
    def load(cls, w: dict[str, QTensor], layer: int, ratio: int) -> "AttentionWeights":
        p = f"blk.{layer}."
        compressor = CompressorWeights.load(w, p + "attn_compressor") if ratio else None
        indexer = IndexerWeights.load(w, p) if ratio and p + "indexer.attn_q_b.weight" in w else None
        return cls(*(w[f"{p}attn_{role}.weight"] for role in ("q_a", "q_a_norm", "q_b", "kv", "kv_a_norm", "sinks",
                                                             "output_a", "output_b")), compressor, indexer)


@dataclass
class CompressorState:
    buf_kv: torch.Tensor | None = None  # projections of tokens of the incomplete window
    buf_gate: torch.Tensor | None = None
    overlap: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: the last window's first series
    entries: torch.Tensor | None = None  # [n, d], normalized and roped
    count: int = 0


@dataclass
class CompressorBuffers:
    """A compressor's state at a fixed shape, for a static decode step to update in place."""
    kv: torch.Tensor  # [ratio, c*d]: the incomplete window's projections at their offset, zeros after
    gate: torch.Tensor
    entries: torch.Tensor  # [ceil(capacity / ratio), d]: those of complete windows; zeros after
    overlap: tuple[torch.Tensor, torch.Tensor] | None  # CSA: [ratio, d] each; zeros and -inf before a window

    @classmethod
    def empty(cls, width: int, d: int, ratio: int, capacity: int, device: torch.device) -> "CompressorBuffers":
        """The state before any token, for `capacity` positions: projections `width` wide (CSA's
        hold two series of d: an overlap, whose gate weighs nothing before a first window)."""
        zeros = partial(torch.zeros, dtype=torch.float32, device=device)
        overlap = (zeros((ratio, d)), torch.full((ratio, d), float("-inf"), device=device)) if width == 2 * d else None
        return cls(zeros((ratio, width)), zeros((ratio, width)), zeros((-(-capacity // ratio), d)), overlap)

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.gate, self.entries, *(self.overlap or ())]

    def store(self, c: CompressorState) -> None:
        """Writes c, an eager compressor's state, into the buffers in place."""
        for buffer, rows in ((self.kv, c.buf_kv), (self.gate, c.buf_gate), (self.entries, c.entries)):
            buffer.zero_()
            buffer[:rows.shape[0]] = rows
        if self.overlap is not None and c.overlap is None:  # before a first window: half a pool that weighs nothing
            self.overlap[0].zero_()
            self.overlap[1].fill_(float("-inf"))
        elif self.overlap is not None:
            self.overlap[0].copy_(c.overlap[0])
            self.overlap[1].copy_(c.overlap[1])

    def load(self, c: CompressorState, length: int, ratio: int) -> None:
        """Sets c to the state after `length` tokens held here."""
        c.count, pending = divmod(length, ratio)
        c.buf_kv, c.buf_gate = self.kv[:pending].clone(), self.gate[:pending].clone()
        c.entries = self.entries[:c.count].clone()
        c.overlap = (self.overlap[0].clone(), self.overlap[1].clone()) if self.overlap is not None and c.count else None


@dataclass
class StepBuffers:
    """A layer's state for positions < capacity, in buffers a captured step reads and writes."""
    capacity: int
    raw: torch.Tensor  # [window - 1, d]: the raw entry of position q in row q % (window - 1)
    compressors: dict[str, CompressorBuffers]
    ties: torch.Tensor | None  # [capacity] bool where the indexer's last pick was a tie (CSA)

    def tensors(self) -> list[torch.Tensor]:
        ties = [] if self.ties is None else [self.ties]
        return [self.raw, *(t for name in sorted(self.compressors) for t in self.compressors[name].tensors()), *ties]


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
    overlap: bool = False  # CSA: its compressor pools overlapping windows (two series per token)
    indexed: bool = False  # CSA: a lightning indexer picks the entries each query sees

    def compressor_shapes(self) -> dict[str, tuple[int, int]]:
        """Each compressor's projection width and entry width."""
        if not self.ratio:
            return {}
        shapes = {"attn": ((2 if self.overlap else 1) * self.head_dim, self.head_dim)}
        return shapes | ({"indexer": (2 * self.index_dim, self.index_dim)} if self.indexed else {})


@dataclass
class LayerState:
    shape: AttentionShape
    device: torch.device | None = None  # where an empty state's buffers go (reserve before a first pass)
    raw: torch.Tensor | None = None  # [S, d]: the last window - 1 raw (roped) entries
    compressors: dict[str, CompressorState] = field(default_factory=dict)
    # Positions whose last indexer pick was a tie (the k-th and the next score equal, often both
    # exactly 0 after ReLU): which entry joins there is a convention, not arithmetic. Static steps
    # mark theirs in buffers.ties, taken into this list before the next eager pass (ties()).
    indexer_ties: list[int] = field(default_factory=list)
    # Once reserved, the buffers hold the state: the fields above are rebuilt from them for an
    # eager pass, which writes its result back in place (a captured step keeps reading them).
    buffers: StepBuffers | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.buffers is None else self.buffers.capacity

    def tensors(self) -> list[torch.Tensor]:
        """What a static step updates in place (saved and restored around a graph's warm-up)."""
        return [] if self.buffers is None else self.buffers.tensors()

    def clear(self) -> None:
        """The state before a first token. Reserved, it is the empty reservation's values written
        into this state's own buffers (a captured step keeps reading them)."""
        self.indexer_ties = []
        self.compressors = {name: CompressorState() for name in self.compressors}
        if self.buffers is None:
            if self.raw is not None:  # an empty state is reserved where its entries were
                self.device = self.raw.device
            self.raw = None
            return
        empty = LayerState(self.shape, self.buffers.raw.device)
        empty.reserve(self.buffers.capacity, 0)
        for mine, fresh in zip(self.tensors(), empty.tensors(), strict=True):
            mine.copy_(fresh)
        self.unpack(0)

    def ties(self) -> list[int]:
        """Every position whose indexer pick was a tie, eager or static (a host sync)."""
        marked = [] if self.buffers is None or self.buffers.ties is None else self.buffers.ties.nonzero()
        return sorted({*self.indexer_ties, *(int(i) for i in marked)})

    def reserve(self, capacity: int, length: int) -> None:
        """Moves the state after `length` tokens into buffers for `capacity` positions (kept if
        they hold as many already)."""
        if self.buffers is not None and self.buffers.capacity >= capacity:
            return
        if self.buffers is not None:
            self.unpack(length)
        empty = self.raw is None
        if empty and (length or self.device is None):
            raise ValueError("a DeepSeek-V4 layer state is reserved before a first pass only when empty and "
                             "given its device")
        device = self.device if empty else self.raw.device
        shape, compressors = self.shape, {}
        for name, (width, d) in shape.compressor_shapes().items():
            compressors[name] = CompressorBuffers.empty(width, d, shape.ratio, capacity, device)
            self.compressors.setdefault(name, CompressorState())
        ties = torch.zeros(capacity, dtype=torch.bool, device=device) if "indexer" in compressors else None
        raw = torch.zeros((max(shape.window - 1, 0), shape.head_dim), device=device)
        self.buffers = StepBuffers(capacity, raw, compressors, ties)
        if empty:
            self.unpack(0)  # the fields an eager pass starts from
        else:
            self.pack(length)

    def pack(self, length: int) -> None:
        """Writes the fields (the state after `length` tokens) into the buffers, in place; grows
        them if an eager pass went past their capacity."""
        b = self.buffers
        if length > b.capacity:
            self.buffers = None
            self.reserve(max(length, 2 * b.capacity), length)
            return
        b.raw.zero_()
        if b.raw.shape[0]:
            b.raw[_ring_rows(length, self.raw.shape[0], b.raw.shape[0], b.raw.device)] = self.raw
        for name, c in b.compressors.items():
            c.store(self.compressors[name])
        if b.ties is not None:
            b.ties.zero_()
            b.ties[torch.tensor(self.indexer_ties, dtype=torch.int64, device=b.ties.device)] = True

    def unpack(self, length: int) -> None:
        """Rebuilds the fields from the buffers (the state after `length` tokens)."""
        b = self.buffers
        kept = min(b.raw.shape[0], length)
        self.raw = b.raw[_ring_rows(length, kept, b.raw.shape[0], b.raw.device)] if kept else b.raw[:0].clone()
        for name, c in b.compressors.items():
            c.load(self.compressors[name], length, self.shape.ratio)
        self.indexer_ties = self.ties()


def _ring_rows(length: int, kept: int, size: int, device: torch.device) -> torch.Tensor:
    """The ring rows of the last `kept` positions before `length`, oldest first."""
    return torch.arange(length - kept, length, device=device) % size


def compress(ops: TorchOps, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
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
        pooled = ops.rms_norm((ckv * torch.softmax(cgate, dim=1)).sum(dim=1), norm, eps)  # [n, d]
        cos, sin = rope.cos_sin(torch.arange(n) * ratio + first, pooled.device)
        pooled = ops.rope_tail(pooled[:, None, :], rope, cos, sin)[:, 0, :]
        state.entries = pooled if state.entries is None else torch.cat([state.entries, pooled])
        state.count += n
    if state.entries is None:
        state.entries = kv.new_zeros((0, d))
    return state.entries


def attention(ops: TorchOps, a: AttentionWeights, x: torch.Tensor, start: int | torch.Tensor, state: LayerState,
              rope: Rope) -> torch.Tensor:
    """x [T, D] (the block's normalized input) at positions start.. -> [T, D]. `start` the
    positions [T] on the device: a static pass over the reserved buffers (_step)."""
    if isinstance(start, torch.Tensor):
        return _step(ops, a, x, start, state, rope)
    if state.buffers is not None:
        state.unpack(start)
    out = _eager(ops, a, x, start, state, rope)
    if state.buffers is not None:
        state.pack(start + x.shape[0])
    return out


def _project(ops: TorchOps, a: AttentionWeights, x: torch.Tensor, shape: AttentionShape, rope: Rope, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query's LoRA input qr [T, q_lora], the queries [T, H, d] and the keys (= values) [T, d]."""
    t, h, d = x.shape[0], shape.n_head, shape.head_dim
    qr = ops.rms_norm(ops.linear(x, a.q_a), ops.dequant(a.q_a_norm), shape.eps)
    q = ops.rms_norm(ops.linear(qr, a.q_b).view(t, h, d), None, shape.eps)
    q = ops.rope_tail(q, rope, cos, sin)
    kv = ops.rms_norm(ops.linear(x, a.kv), ops.dequant(a.kv_norm), shape.eps)
    return qr, q, ops.rope_tail(kv[:, None, :], rope, cos, sin)[:, 0, :]


def _attend(ops: TorchOps, a: AttentionWeights, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, shape: AttentionShape,
            rope: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [T, H, d] over keys (= values) [S, d] where visible [T, S] -> the block's output [T, D]."""
    t, d = q.shape[0], q.shape[2]
    out = ops.shared_head_attention(q, keys, visible, d ** -0.5, ops.dequant(a.sinks))
    out = ops.rope_tail(out, rope, cos, sin, inverse=True)  # V carried the rotation: undo it at the query's position

    grouped = ops.head_linear(out.reshape(t, shape.o_groups, -1), a.output_a)  # [T, g, o_lora]
    return ops.linear(grouped.reshape(t, -1), a.output_b)


def _eager(ops: TorchOps, a: AttentionWeights, x: torch.Tensor, tokens_start: int, state: LayerState, rope: Rope) -> torch.Tensor:
    """Any number of tokens, the caches growing as one long pass would see them."""
    t, shape = x.shape[0], state.shape
    positions = torch.arange(tokens_start, tokens_start + t)
    cos, sin = rope.cos_sin(positions, x.device)
    qr, q, kv = _project(ops, a, x, shape, rope, cos, sin)

    raw = kv if state.raw is None else torch.cat([state.raw, kv])
    raw_start = tokens_start + t - raw.shape[0]
    qpos = positions.to(x.device)[:, None]
    kpos = torch.arange(raw_start, raw_start + raw.shape[0], device=x.device)[None, :]
    visible = (kpos <= qpos) & (qpos - kpos < shape.window)  # [T, S]
    keys = raw
    if shape.ratio:
        c = state.compressors.setdefault("attn", CompressorState())
        entries = compress(ops, c, *a.compressor.inputs(ops, x), shape.ratio, shape.overlap, rope, shape.eps)
        threshold = (qpos + 1) // shape.ratio  # entries a query may see
        seen = torch.arange(entries.shape[0], device=x.device)[None, :] < threshold
        if shape.indexed:
            seen &= _indexer_picks(ops, a.indexer, x, qr, positions, state, rope, cos, sin, threshold)
        keys = torch.cat([raw, entries])
        visible = torch.cat([visible, seen], dim=1)
    state.raw = raw[-(shape.window - 1):] if shape.window > 1 else raw[:0]
    return _attend(ops, a, q, keys, visible, shape, rope, cos, sin)


def _step(ops: TorchOps, a: AttentionWeights, x: torch.Tensor, positions: torch.Tensor, state: LayerState, rope: Rope
          ) -> torch.Tensor:
    """T tokens at the device positions [T] (a decode step's one, or a short prompt's) over the
    reserved buffers: keys are the ring of raw entries, the tokens' own, and every entry row,
    masked by position; the same shapes and operations at every position, the buffers updated in
    place."""
    shape, b, t = state.shape, state.buffers, x.shape[0]
    if b is None:
        raise ValueError("a static DeepSeek-V4 pass needs its state reserved first (KVCache.reserve)")
    cos, sin = rope.at(positions, b.capacity)
    qr, q, kv = _project(ops, a, x, shape, rope, cos, sin)

    size, keys, n_entries, picked = b.raw.shape[0], [b.raw, kv], 0, None
    if shape.ratio:
        compressed = _compress_step if t == 1 else _compress_pass
        entries = compressed(ops, b.compressors["attn"], *a.compressor.inputs(ops, x), shape.ratio, positions, rope, shape.eps,
                             b.capacity)
        keys.append(entries)
        n_entries = entries.shape[0]
        if shape.indexed:
            keys_index = compressed(ops, b.compressors["indexer"], *a.indexer.compressor.inputs(ops, x), shape.ratio, positions,
                                    rope, shape.eps, b.capacity)
            if n_entries > shape.index_topk:  # else it picks every entry a query sees (_top)
                index = _index_scores(ops, a.indexer, x, qr, keys_index, shape, rope, cos, sin)
                picked, tie = _top(index, _entries_seen(positions, n_entries, shape.ratio), shape.index_topk)
                if tie is not None:
                    b.ties.index_copy_(0, positions, tie)
    visible = _visible(ops, positions, size, n_entries, shape.ratio, shape.window)
    if picked is not None:
        visible[:, size + t:] = picked
    keys = torch.cat(keys)
    if size:  # over the positions that just left the window (the last `size` tokens where more came)
        m = min(t, size)
        b.raw.index_copy_(0, positions[t - m:] % size, kv[t - m:])
    return _attend(ops, a, q, keys, visible, shape, rope, cos, sin)


def _visible(ops: TorchOps, positions: torch.Tensor, size: int, n_entries: int, ratio: int, window: int) -> torch.Tensor:
    """[T, size + T + n_entries] bool: the keys of a static pass (the ring of `size` raw entries,
    the tokens' own, the entry rows) that each of its tokens at `positions` [T] sees."""
    t, device = positions.shape[0], positions.device
    if t == 1 and ops.kernels:
        return ops.step_visible(positions, size, n_entries, ratio)
    first = positions[:1]
    held = first - 1 - (first - 1 - torch.arange(size, device=device)) % size  # [S]: each row's position
    if t == 1:  # the ring holds the window before the token, which sees itself
        visible = torch.cat([held >= 0, torch.ones_like(positions, dtype=torch.bool)])[None]  # [1, S + 1]
    else:
        held_and_new = torch.cat([held, positions])
        ahead = positions[:, None] - held_and_new[None]  # [T, S + T]: the query's position minus the key's
        visible = (held_and_new >= 0)[None] & (ahead >= 0) & (ahead < window)
    return torch.cat([visible, _entries_seen(positions, n_entries, ratio)], dim=1) if n_entries else visible


def _entries_seen(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[T, n_entries] bool: the entries of complete windows, for each token at `positions` [T]."""
    return torch.arange(n_entries, device=positions.device)[None, :] < (positions[:, None] + 1) // ratio


def _compress_step(ops: TorchOps, c: CompressorBuffers, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor,
                   ratio: int, position: torch.Tensor, rope: Rope, eps: float, capacity: int) -> torch.Tensor:
    """compress for one token at a device position: it joins its window at its offset; the
    window's entry is pooled as compress pools it, at every step, and written (with the overlap
    moving on and the window's rows cleared) only where the window completes. Returns every
    entry row [n, d]."""
    if ops.kernels and rope.style is RopeStyle.NORM:
        ops.compress_step(c.kv, c.gate, c.overlap, c.entries, kv, gate, ape, norm, eps, position,
                      *rope.table(kv.device, capacity), rope.dim)
        return c.entries
    offset = position % ratio
    c.kv.index_copy_(0, offset, kv)
    c.gate.index_copy_(0, offset, gate)
    complete = offset == ratio - 1  # [1]
    d = norm.shape[0]
    ckv, cgate = c.kv[None], c.gate[None] + ape  # [1, ratio, c*d]
    if c.overlap is not None:  # the previous window's first series, then this window's second
        pool_kv = torch.cat([c.overlap[0][None], ckv[..., d:]], dim=1)  # [1, 2 * ratio, d]
        pool_gate = torch.cat([c.overlap[1][None], cgate[..., d:]], dim=1)
        c.overlap[0].copy_(torch.where(complete, ckv[0, :, :d], c.overlap[0]))
        c.overlap[1].copy_(torch.where(complete, cgate[0, :, :d], c.overlap[1]))
        ckv, cgate = pool_kv, pool_gate
    pooled = ops.rms_norm((ckv * torch.softmax(cgate, dim=1)).sum(dim=1), norm, eps)  # [1, d]
    window = position // ratio
    cos, sin = rope.at(window * ratio, capacity)
    pooled = ops.rope_tail(pooled[:, None, :], rope, cos, sin)[:, 0, :]
    c.entries.index_copy_(0, window, torch.where(complete, pooled, c.entries.index_select(0, window)))
    c.kv.masked_fill_(complete, 0)
    c.gate.masked_fill_(complete, 0)
    return c.entries


def _compress_pass(ops: TorchOps, c: CompressorBuffers, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor,
                   ratio: int, positions: torch.Tensor, rope: Rope, eps: float, capacity: int) -> torch.Tensor:
    """compress for T tokens at consecutive device positions [T] (a short prompt's) with static
    shapes: the windows the pass can touch (T // ratio + 2 from the first token's) laid out as a
    grid of the incomplete window's held rows and the new tokens at their offsets, each pooled as
    compress pools it; the entries of the windows the pass completes written, the overlap moved
    to the last of them, and the held rows replaced by the window the next token joins. Returns
    every entry row [n, d]."""
    t, n_win, device = kv.shape[0], kv.shape[0] // ratio + 2, kv.device
    offsets = torch.arange(ratio, device=device)
    first_window = positions[:1] // ratio  # [1]
    windows = first_window + torch.arange(n_win, device=device)  # [W]
    rank = (windows[:, None] * ratio + offsets[None]) - positions[:1]  # [W, ratio]: index among the new tokens
    new, held = ((rank >= 0) & (rank < t))[..., None], (rank < 0)[..., None]
    pick = rank.clamp(0, t - 1)
    grid_kv = torch.where(new, kv[pick], torch.where(held, c.kv[None], 0.0))  # [W, ratio, c*d]
    grid_gate = torch.where(new, gate[pick], torch.where(held, c.gate[None], 0.0))
    complete = windows * ratio + ratio - 1 <= positions[-1:]  # [W]
    d = norm.shape[0]
    ckv, cgate = grid_kv, grid_gate + ape
    following = (positions[-1:] + 1) // ratio - first_window  # [1]: the window the next token joins
    if c.overlap is not None:  # each window's previous first series, then its own second
        pool_kv = torch.cat([torch.cat([c.overlap[0][None], ckv[:-1, :, :d]]), ckv[..., d:]], dim=1)  # [W, 2r, d]
        pool_gate = torch.cat([torch.cat([c.overlap[1][None], cgate[:-1, :, :d]]), cgate[..., d:]], dim=1)
        moved, last = following > 0, (following - 1).clamp(min=0)  # the last window the pass completed
        c.overlap[0].copy_(torch.where(moved, ckv.index_select(0, last)[0, :, :d], c.overlap[0]))
        c.overlap[1].copy_(torch.where(moved, cgate.index_select(0, last)[0, :, :d], c.overlap[1]))
        ckv, cgate = pool_kv, pool_gate
    pooled = ops.rms_norm((ckv * torch.softmax(cgate, dim=1)).sum(dim=1), norm, eps)  # [W, d]
    cos, sin = rope.at((windows * ratio).clamp(max=capacity - 1), capacity)  # incomplete windows: never written
    pooled = ops.rope_tail(pooled[:, None, :], rope, cos, sin)[:, 0, :]
    row = torch.arange(c.entries.shape[0], device=device) - first_window  # [n]: window index in the grid
    inside = (row >= 0) & (row < n_win)
    row = row.clamp(0, n_win - 1)
    c.entries.copy_(torch.where((inside & complete[row])[:, None], pooled[row], c.entries))
    c.kv.copy_(grid_kv.index_select(0, following)[0])
    c.gate.copy_(grid_gate.index_select(0, following)[0])
    return c.entries


def _index_scores(ops: TorchOps, ix: IndexerWeights, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, shape: AttentionShape,
                  rope: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's score [T, n] of each entry (keys [n, d_index]) for each query."""
    t = x.shape[0]
    q = ops.rope_tail(ops.linear(qr, ix.q_b).view(t, shape.index_heads, shape.index_dim), rope, cos, sin)
    scores = torch.relu(torch.einsum("thd,sd->ths", q, keys)) * shape.index_dim ** -0.5
    weights = ops.linear(x, ix.proj) * shape.index_heads ** -0.5  # [T, heads]
    return (scores * weights[..., None]).sum(dim=1)  # [T, n]


def _top(index: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, n] bool: the top k of index [T, n] among the valid entries, and [T] where the k-th
    pick ties with the next valid score (None when there are at most k entries).

    torch.topk, as transformers picks. Entries often tie (ReLU makes many scores exactly 0) and
    topk leaves ties unspecified: a tie at the last pick may go either way on another device or
    tensor shape (prefill vs decode), so callers record those positions."""
    n = index.shape[1]
    k = min(k, n)
    masked = index.masked_fill(~valid, float("-inf"))
    top = masked.topk(k, dim=-1).indices
    picked = torch.zeros_like(valid).scatter_(1, top, True)
    tie = None
    if k < n:
        last = masked.gather(1, top).min(dim=-1).values
        next_best = masked.masked_fill(picked, float("-inf")).max(dim=-1).values
        tie = (last == next_best) & (next_best > float("-inf"))
    return picked & valid, tie


def _indexer_picks(ops: TorchOps, ix: IndexerWeights, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                   state: LayerState, rope: Rope, cos: torch.Tensor, sin: torch.Tensor, threshold: torch.Tensor
                   ) -> torch.Tensor:
    """[T, n_entries] bool: the entries the lightning indexer picks for each query."""
    shape = state.shape
    c = state.compressors.setdefault("indexer", CompressorState())
    keys = compress(ops, c, *ix.compressor.inputs(ops, x), shape.ratio, True, rope, shape.eps)
    t, n = x.shape[0], keys.shape[0]
    if n == 0:
        return torch.zeros((t, n), dtype=torch.bool, device=x.device)
    index = _index_scores(ops, ix, x, qr, keys, shape, rope, cos, sin)
    picked, tie = _top(index, torch.arange(n, device=x.device)[None, :] < threshold, shape.index_topk)
    if tie is not None:
        state.indexer_ties.extend(positions[tie.cpu()].tolist())
    return picked
