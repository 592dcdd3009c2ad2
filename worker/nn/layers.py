"""The building blocks every architecture file wires together: RMSNorm, rotary embeddings (both of
llama.cpp's layouts, with YaRN), causal attention over a KV cache (GQA, sliding window, attention
sinks). The formulas here are torch's, the reference (ops.TorchOps); the kernels' are
triton_ops.TritonOps'. No quant formats, no sockets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch



def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


class RopeStyle(Enum):
    NEOX = "neox"  # rotate the two halves of the head dimension (Qwen, gpt-oss)
    NORM = "norm"  # rotate adjacent pairs (llama.cpp's LLAMA, DeepSeek: converters permute q/k to it)


@dataclass(frozen=True)
class Rope:
    dim: int  # rotated channels per head
    base: float
    style: RopeStyle
    # YaRN (rope.scaling.type == "yarn"); factor 1 means plain RoPE
    factor: float = 1.0
    original_context: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the YaRN correction range to whole dimensions (gpt-oss does not)
    mscale: float = 1.0  # multiplies cos and sin (YaRN's attention factor)
    # device -> every (cos, sin) [N, dim/2] table made, the longest last: a captured decode step reads
    # the one it was captured with, so a longer table never frees a shorter one.
    _tables: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    def inv_freq(self) -> torch.Tensor:
        """transformers' formulas, operation for operation (the reference logits come from them)."""
        pos_freqs = self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).to(torch.float32) / self.dim)
        if self.factor == 1.0:
            return 1.0 / pos_freqs
        # YaRN: interpolate the low frequencies, keep the high ones, blend in between.
        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(self.original_context / (rotations * 2 * math.pi))) / (2 * math.log(self.base))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    @staticmethod
    def yarn_mscale(factor: float) -> float:
        return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed on the CPU, then moved: the same tables on every device."""
        freqs = positions.cpu().to(torch.float32)[:, None] * self.inv_freq()[None, :]  # [T, dim/2]
        return (freqs.cos() * self.mscale).to(device), (freqs.sin() * self.mscale).to(device)

    def at(self, positions: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, dim/2] of `positions` (on the device, < upto) looked up in a table made once
        on the CPU with cos_sin's arithmetic (so the same values) and kept on the device: no host
        work per step, which a captured decode step needs."""
        cos, sin = self.table(positions.device, upto)
        return cos[positions], sin[positions]

    def table(self, device: torch.device, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, dim/2] of positions 0..N-1 (N >= upto) on `device`, for `at` and for kernels
        that look positions up themselves."""
        tables = self._tables.setdefault(device, [])
        if not tables or tables[-1][0].shape[0] < upto:
            size = max(upto, 2 * tables[-1][0].shape[0] if tables else 1024)
            tables.append(self.cos_sin(torch.arange(size), device))
        return tables[-1]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, d]: rotates the first `dim` channels (cos/sin [T, dim/2])."""
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        c, s = cos[:, None, :], sin[:, None, :]
        if self.style is RopeStyle.NEOX:
            a, b = rot[..., :self.dim // 2], rot[..., self.dim // 2:]
            out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


INITIAL_CAPACITY = 256  # positions a layer's KV buffers start with (then doubled as needed)


class LayerCache(Protocol):
    """An architecture's own per-layer state beside the keys and values (kda.KdaState,
    compressed_attention.LayerState): what a static decode step updates in place."""

    @property
    def capacity(self) -> int | None:
        """Positions its buffers hold; None for a state of one size at every position."""

    def reserve(self, capacity: int, length: int) -> None:
        """Makes the state after `length` tokens ready for static steps up to `capacity` positions."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a static step writes."""

    def clear(self) -> None:
        """The state before a first token, in this state's own tensors (a sequence slot reused:
        the graphs captured over them stay valid)."""


@dataclass
class KVCache:
    """Keys and values of every layer, in buffers allocated ahead (zeros, grown by doubling) and
    written at the tokens' positions. Eager passes see the first `length + T` rows. A static pass
    (a decode step or a short prompt, engine.DecodeGraph) sets `step_positions`, a device tensor
    holding the positions of its tokens: it then writes there and attends over the whole buffer,
    masked by position, so the pass has the same shapes at every position. `generation` counts the
    times a buffer was replaced by a larger one: a captured graph reads the tensors it was
    captured over, so the engine captures a slot's graphs again when it changed (engine/arena.py)."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [capacity, Hkv, d]
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0  # tokens before the current forward pass
    state: dict[int, LayerCache] = field(default_factory=dict)  # layer -> an architecture's own cache
    step_positions: torch.Tensor | None = None
    # step_positions on the other devices of a worker split over several (placement.py), written
    # once per step by the engine
    step_copies: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    reserved: int = 0  # positions reserve() asked for: the size of a static pass's buffers made anew
    generation: int = 0

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Positions [T] of the tokens of this pass, on the device."""
        if self.step_positions is not None:
            if not self.step_copies or self.step_positions.device == device:
                return self.step_positions  # one device: a captured step reads this very tensor
            copy = self.step_copies.get(device)
            return copy if copy is not None else self.step_positions.to(device)
        return torch.arange(self.length, self.length + t, device=device)

    def bound(self, t: int) -> int:
        """An upper bound on the positions of this pass (tables sized by it)."""
        return self.capacity if self.step_positions is not None else self.length + t

    @property
    def capacity(self) -> int:
        """Positions every layer's buffers hold (a state of one size at every position counts none)."""
        sizes = [k.shape[0] for k in self.keys.values()]
        sizes += [s.capacity for s in self.state.values() if s.capacity is not None]
        return min(sizes, default=self.reserved)

    def reserve(self, capacity: int) -> None:
        """Grows every layer's buffers, and moves the architectures' states into theirs, to hold
        `capacity` positions."""
        self.reserved = max(self.reserved, capacity)
        self.generation += 1
        for layer in self.keys:
            self.keys[layer] = _grown(self.keys[layer], capacity)
            self.values[layer] = _grown(self.values[layer], capacity)
        for state in self.state.values():
            state.reserve(capacity, self.length)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k/v [T, Hkv, d] at this pass's positions; returns the keys and values to attend."""
        keys, values, seen = self.buffers(layer, k.shape[0], k.shape[1:], v.shape[1:], k)
        if self.step_positions is not None:
            positions = self.positions(k.shape[0], k.device)
            keys.index_copy_(0, positions, k)
            values.index_copy_(0, positions, v)
        else:
            keys[self.length:seen] = k
            values[self.length:seen] = v
        return keys[:seen], values[:seen]

    def buffers(self, layer: int, t: int, k_shape: torch.Size, v_shape: torch.Size, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer's key and value buffers [capacity, ...], made or grown to hold this pass's T tokens,
        and how many leading rows its queries attend (all of them in a captured step). Buffers of
        another row shape go first: a slot's new sequence may lay its keys out otherwise (MLA's
        latent form on the kernels' path, per-head keys on torch's)."""
        kept = self.keys.get(layer)
        if kept is not None and (kept.shape[1:] != k_shape or self.values[layer].shape[1:] != v_shape):
            del self.keys[layer], self.values[layer]
        if self.step_positions is not None:
            if layer not in self.keys:  # a static prompt into an empty cache: its reserved size
                self.generation += 1
                self.keys[layer] = like.new_zeros((self.reserved, *k_shape))
                self.values[layer] = like.new_zeros((self.reserved, *v_shape))
            return self.keys[layer], self.values[layer], self.keys[layer].shape[0]
        end = self.length + t
        if layer not in self.keys or self.keys[layer].shape[0] < end:
            self.generation += 1
        if layer not in self.keys:
            self.keys[layer] = like.new_zeros((max(end, INITIAL_CAPACITY), *k_shape))
            self.values[layer] = like.new_zeros((max(end, INITIAL_CAPACITY), *v_shape))
        elif self.keys[layer].shape[0] < end:
            size = max(end, 2 * self.keys[layer].shape[0])
            self.keys[layer], self.values[layer] = _grown(self.keys[layer], size), _grown(self.values[layer], size)
        return self.keys[layer], self.values[layer], end

    def buffer_ptrs(self) -> tuple[int, ...]:
        """Where every buffer a static pass writes lies: what a captured graph reads."""
        return (*(t.data_ptr() for layer in sorted(self.keys) for t in (self.keys[layer], self.values[layer])),
                *(t.data_ptr() for t in self.state_tensors()))

    def clear(self) -> None:
        """Empty again, buffers kept: a new sequence in this slot writes its rows over the old ones
        before it reads them (attention sees positions up to its own), and every state starts
        over in place."""
        self.length = 0
        self.step_positions = None
        self.step_copies = {}
        with torch.inference_mode():  # the states are the passes' (inference) tensors
            for state in self.state.values():
                state.clear()

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors of the architectures' own states (KDA's, DeepSeek-V4's reserved buffers),
        which a step updates in place."""
        return [t for layer in sorted(self.state) for t in self.state[layer].tensors()]

    def advance(self, t: int) -> None:
        """The pass's T tokens are in: the next pass starts after them."""
        self.length += t


class BatchKV:
    """One step of several sequences together: row i of the step is the next token of `caches[i]`,
    or with `counts` the rows come in runs, counts[i] tokens of caches[i] one after another (a
    prompt's piece beside other sequences' next tokens: Engine.mixed_step). What the models that
    take it (Model.batched_decode) read of a KVCache: each run's positions follow its own
    sequence's length; its keys and values go into, and its attention reads, its own cache only
    (gqa.gqa_attention attends run by run, a run causally as a prompt). Everything else in the
    step (the matrices, the experts) runs on all rows at once.

    Eager, or static (engine.BatchDecode, a CUDA graph of the step; one token a sequence):
    `positions` [rows] on the device then holds each row's position, and each cache's
    step_positions is its row of it, so every row writes and attends as a static one-sequence
    step does, at every position alike."""

    def __init__(self, caches: list[KVCache], positions: torch.Tensor | None = None,
                 counts: list[int] | None = None) -> None:
        if any((c.step_positions is not None) != (positions is not None) for c in caches):
            raise ValueError("a batched step's caches are inside its static pass (positions given) or none is")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a sequence appears twice in one batched step")
        self.counts = [1] * len(caches) if counts is None else list(counts)
        if len(self.counts) != len(caches) or min(self.counts, default=1) < 1:
            raise ValueError(f"a batched step takes one run of tokens or more a sequence: {self.counts} for "
                             f"{len(caches)} sequences")
        if positions is not None and max(self.counts, default=1) > 1:
            raise ValueError("a static batched step takes one token a sequence")
        self.caches = caches
        self.static_positions = positions

    def segments(self) -> list[tuple[KVCache, slice]]:
        """Each sequence's cache and its rows of the step."""
        out, start = [], 0
        for c, n in zip(self.caches, self.counts):
            out.append((c, slice(start, start + n)))
            start += n
        return out

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        if self.static_positions is not None:
            self._rows(t)
            return self.static_positions
        return torch.cat([torch.arange(c.length, c.length + n, dtype=torch.int64)
                          for c, n in zip(self._rows(t), self.counts)]).to(device)

    def bound(self, t: int) -> int:
        rows = self._rows(t)
        if self.static_positions is not None:
            return max(c.bound(1) for c in rows)  # the rows' capacities: a static pass attends whole buffers
        return max(c.length + n for c, n in zip(rows, self.counts))

    def advance(self, t: int) -> None:
        for c, n in zip(self._rows(t), self.counts):
            c.length += n

    def _rows(self, t: int) -> list[KVCache]:
        if t != sum(self.counts):
            raise ValueError(f"a batched step of {self.counts} tokens by sequence got {t} tokens")
        return self.caches


def _grown(buffer: torch.Tensor, size: int) -> torch.Tensor:
    if buffer.shape[0] >= size:
        return buffer
    out = buffer.new_zeros((size, *buffer.shape[1:]))
    out[:buffer.shape[0]] = buffer
    return out


DECODE_MAX_QUERIES = 8  # up to this many queries, attention runs as the fused decode kernel


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, scale: float,
              window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries at positions start.. (or at the positions [T] given on the
    device) over keys at 0..S-1.
    q [T, H, d], k [S, Hkv, d], v [S, Hkv, dv] -> [T, H, dv]. `window`: a query sees the last
    `window` positions only (itself included). `sinks` [H]: a learned logit per head that joins
    the softmax and takes probability mass without contributing a value."""
    t, h = q.shape[0], q.shape[1]
    s, hkv = k.shape[0], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    qpos = (start if isinstance(start, torch.Tensor) else torch.arange(start, start + t, device=q.device))[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(h, 1, 1).expand(h, t, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hts,shd->thd", probs, v)
