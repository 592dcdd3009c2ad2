"""A decode step (or a short prompt) captured as CUDA graphs over one sequence's buffers: the whole
step as one graph where every expert is resident (DecodeGraph), or segments split at the MoE layers
where the expert cache's misses need the host between them (SegmentedDecode), or the whole step as
one graph that looks the cache's experts up on the device and is kept only where it found them all
(TableDecode). The kernels and their inputs are those of the eager step, so a replay gives the eager
step's bits."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from ..experts.expert_cache import AHEAD_TRANSIT, ExpertCache
from ..experts.source import ExpertRows
from ..nn.layers import BatchKV, KVCache
from ..nn.ops import AheadSlots

if TYPE_CHECKING:
    from ..experts.lookahead import Guesses
    from ..models import Model

# Kept blocks a table step copies ahead for the next layer: the router's likeliest guesses only,
# about as many as PCIe moves while this layer computes (~0.1-0.15 ms, 5-7.5 MB at 50 GB/s: two or
# three Q4_K experts of Qwen3-30B-A3B). Copying all k guesses made the next layer wait for them and
# spent 13% more PCIe on the wrong ones (the traces of decode_streaming --trace). On the H100
# (BENCHMARKS.md), Q3-12L: over a warm RAM tier (1 GiB cache) 2 blocks 1.12x of none, 1 block
# 1.05x, 3 (at 32 programs a block) 1.10x, and 3 at 16 programs 1.00x of 2 (2026-12-08); at the
# 4 / 8 GiB split's cache (2.451 GiB) 3 blocks 1.03x of 2, 4 blocks 0.97x.
AHEAD_BLOCKS = 3


class StaticInputs:
    """A static pass's inputs on the device and the caches it runs over: `tokens` consecutive
    positions of one sequence (a decode step, a short prompt), or, given a list of caches, one
    position in each (a batched step of several sequences: BatchKV's static mode). `token` and
    `position` are the tensors a captured pass reads; `write` puts a step's in."""

    def __init__(self, cache: KVCache | list[KVCache], tokens: int, device: torch.device) -> None:
        self.batched = isinstance(cache, list)
        self.caches: list[KVCache] = cache if self.batched else [cache]
        n = len(self.caches) if self.batched else tokens
        self._inputs = torch.zeros(2, n, dtype=torch.int64, device=device)  # tokens, positions: one upload
        self.token, self.position = self._inputs[0], self._inputs[1]
        self._offsets = torch.arange(n, dtype=torch.int64, device=device)
        self.write([0] * n if n > 1 else 0)

    @property
    def lengths(self) -> list[int]:
        return [c.length for c in self.caches]

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        for c, length in zip(self.caches, lengths, strict=True):
            c.length = length

    def write(self, tokens: int | list[int]) -> None:
        """The next step's token(s), each row at its sequence's length."""
        if isinstance(tokens, int):  # one sequence's next token: no upload
            self.token.fill_(tokens)
            self.position.fill_(self.caches[0].length)
        elif self.batched:
            self._inputs.copy_(torch.tensor([tokens, self.lengths], dtype=torch.int64))
        else:
            self.token.copy_(torch.tensor(tokens, dtype=torch.int64))
            torch.add(self._offsets, self.caches[0].length, out=self.position)

    def advance(self) -> None:
        """The step's tokens are in their sequences."""
        for c in self.caches:
            c.length += 1 if self.batched else self.token.shape[0]

    @contextlib.contextmanager
    def entered(self) -> Iterator[KVCache | BatchKV]:
        """The caches inside the pass (each reads its positions from `position`): the model's kv."""
        try:
            if self.batched:
                for i, c in enumerate(self.caches):
                    c.step_positions = self.position[i:i + 1]
                kv: KVCache | BatchKV = BatchKV(self.caches, self.position)
            else:
                self.caches[0].step_positions = self.position
                kv = self.caches[0]
            yield kv
        finally:
            for c in self.caches:
                c.step_positions = None


class DecodeGraph:
    """One model's decode step (or a prompt of `tokens` tokens, logits of its last with `last`;
    or, given a list of caches, a batched step of one token each) captured as a CUDA graph over
    the KV caches (their buffers reserved ahead), replayed per step: the tokens and their
    positions are written into static device buffers and the step runs as one launch instead of
    hundreds from Python. Captured after a warm-up on a side stream (kernels compile, vectors are
    made), as torch.cuda.graph asks; into `pool` where given (graphs that never run at once can
    share one)."""

    def __init__(self, model: Model, cache: KVCache | list[KVCache], device: torch.device, tokens: int = 1,
                 last: bool = False, pool: object = None) -> None:
        self.model = model
        self.inputs = inputs = StaticInputs(cache, tokens, device)
        lengths = inputs.lengths
        states = [t.clone() for c in inputs.caches for t in c.state_tensors()]  # the warm-up advances them
        try:
            with inputs.entered() as kv:
                if not all(c.keys for c in inputs.caches):  # a pass into an empty cache: its buffers
                    model.forward(inputs.token, kv, last)  # made on the stream that uses them
                    inputs.lengths = lengths
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # writes the next positions' keys, which the first replay overwrites
                        model.forward(inputs.token, kv, last)
                        inputs.lengths = lengths
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool):
                    self.logits = model.forward(inputs.token, kv, last).to(torch.float32)
        finally:
            inputs.lengths = lengths
            for live, saved in zip((t for c in inputs.caches for t in c.state_tensors()), states):
                live.copy_(saved)
        self.buffers = buffers_of(inputs.caches)  # what the graph reads

    def step(self, tokens: int | list[int]) -> torch.Tensor:
        """Logits after a token (a decode step's), after the prompt's `tokens`, or after each
        sequence's token (a batched step)."""
        self.inputs.write(tokens)
        self.graph.replay()
        self.inputs.advance()
        return self.logits.clone()


def buffers_of(caches: list[KVCache]) -> tuple[tuple[int, int], ...]:
    """What graphs over these caches depend on: a cache's buffers are replaced only when they grow
    (generation), and an architecture's states grow with its capacity."""
    return tuple((c.generation, c.capacity) for c in caches)


@dataclass
class _Stop:
    """Where a segmented step stops at one MoE layer, and the static buffers the graphs on either
    side share with the host step between them."""
    layer: int
    n_pairs: int  # T*k
    targets: tuple[int, ...]  # the later layers the lookahead's guesses are for (prefetch), nearest first
    routed: torch.Tensor  # [T*k (+ T*k per target)] int64, device: the layer's ids, then each guess
    offsets: torch.Tensor  # [T*k] int64, device: where each pair's expert sits in the cache's memory
    staged: torch.Tensor  # [T*k] int64, host (pinned on CUDA): the offsets on their way up

    @classmethod
    def make(cls, layer: int, n_pairs: int, guesses: Guesses, device: torch.device) -> "_Stop":
        assert all(ids.numel() == n_pairs for _, ids in guesses), "a guess is k experts of the step's token"
        return cls(layer, n_pairs, tuple(target for target, _ in guesses),
                   torch.zeros(n_pairs * (1 + len(guesses)), dtype=torch.int64, device=device),
                   torch.zeros(n_pairs, dtype=torch.int64, device=device),
                   torch.zeros(n_pairs, dtype=torch.int64, pin_memory=device.type == "cuda"))


class SegmentedDecode:
    """A decode step over the expert cache as CUDA graphs split at the MoE layers (at most one host
    sync per MoE layer, the GPU fast path's aim): graph 0 runs from the embedding to the first MoE
    layer's routing, graph i the experts of MoE layer i-1 and everything up to layer i's routing,
    the last one the last layer's experts and the output head. Between two graphs, on the host:
    the layer's ids and the lookahead's guesses for the layers ahead, copied to the host together
    (the one sync), then ExpertFFN.host_step (prefetch, hits, the fetch of misses and their
    copies, the compute stream waiting on them) and the offsets copied from a pinned buffer into
    the static one the next graph reads, on the compute stream. The kernels and their inputs are
    those of the eager step: the same bits.

    The first step runs the segments eagerly (kernels compile; the stops' buffers are made) and is
    then captured, once per KV cache buffers like DecodeGraph; later steps replay. A capture that
    fails leaves `failed` set (the engine then steps eagerly). On the CPU (Triton's interpreter,
    tests) nothing is captured: every step runs the segments eagerly, through the same stops,
    buffers and host steps. Given a list of caches, the step is a batched one (a token each, as
    DecodeGraph's), whose rows' experts the host acquires together at each stop; into `pool` where
    given."""

    def __init__(self, model: Model, cache: KVCache | list[KVCache], device: torch.device, pool: object = None
                 ) -> None:
        self.model, self.device = model, device
        self.inputs = StaticInputs(cache, 1, device)
        self.buffers = buffers_of(self.inputs.caches)  # a pass into a cache without buffers runs eagerly first
        self.prefetch = model.moe.prefetch  # captured with or without the guesses' router
        self.stops: list[_Stop] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []  # len(stops) + 1 once captured
        self.logits: torch.Tensor | None = None  # the last graph's output
        self.failed: RuntimeError | None = None
        self.pool = pool  # the memory pool the graphs share (their own where none is given)
        self._at = 0  # the stop the pass reaches next
        self._capturing = False
        self._open: torch.cuda.CUDAGraph | None = None  # the graph being captured

    @staticmethod
    def fits(model: Model, rows: int = 1) -> bool:
        """A step's experts fit the cache in one wave (`rows` tokens' k). (DeepSeek-V4's hash
        layers, whose experts follow from the token, are looked up in the graph from its token buffer.)"""
        source = model.moe.source
        return isinstance(source, ExpertCache) and source.capacity >= rows * source.manifest.model.n_expert_used

    def step(self, tokens: int | list[int]) -> torch.Tensor:
        """Logits after a token (one sequence's), or after each sequence's (a batched step)."""
        self.inputs.write(tokens)
        if not self.graphs:
            logits = self._pass()
            self.buffers = buffers_of(self.inputs.caches)
            if self.device.type == "cuda" and self.failed is None:
                self._capture()
            return logits
        for graph, stop in zip(self.graphs, self.stops):
            graph.replay()
            self._between(stop)
        self.graphs[-1].replay()
        self.inputs.advance()
        return self.logits.clone()

    def _pass(self, capture: bool = False) -> torch.Tensor:
        """One forward pass through the stops: eagerly (each stop's host step runs there), or
        captured (each stop ends a graph and begins the next)."""
        moe = self.model.moe
        self._at, self._capturing = 0, capture
        moe.boundary = self._boundary
        try:
            with self.inputs.entered() as kv:
                logits = self.model.forward(self.inputs.token, kv).to(torch.float32)
        finally:
            moe.boundary = None
            self._capturing = False
        if self._at != len(self.stops):
            raise RuntimeError(f"the pass stopped at {self._at} MoE layers, the step has {len(self.stops)}")
        return logits

    def _boundary(self, layer: int, ids: torch.Tensor, x: torch.Tensor) -> ExpertRows:
        """ExpertFFN's stop at `layer`: the routing (and the lookahead's guesses from the router's
        input `x`) into the stop's buffer, then the host step (eager) or the end of one graph and
        the start of the next (capture)."""
        guesses = self.model.moe.guesses(layer, x)
        if self._at == len(self.stops) and not self._capturing:
            self.stops.append(_Stop.make(layer, ids.numel(), guesses, self.device))
        stop = self.stops[self._at] if self._at < len(self.stops) else None
        targets = tuple(target for target, _ in guesses)
        if stop is None or (stop.layer, stop.n_pairs, stop.targets) != (layer, ids.numel(), targets):
            raise RuntimeError(f"MoE layer {layer} is not where the step stopped before")
        self._at += 1
        n = stop.n_pairs
        stop.routed[:n].copy_(ids.reshape(-1))
        for i, (_, guess) in enumerate(guesses, start=1):
            stop.routed[i * n:(i + 1) * n].copy_(guess.reshape(-1))
        if self._capturing:
            self._open.capture_end()
            self._open = None
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(self.pool)
            self._open = graph
            self.graphs.append(graph)
        else:
            self._between(stop)
        return ExpertRows(self.model.moe.source.memory, stop.offsets)

    def _between(self, stop: _Stop) -> None:
        """The host step at a stop. Its first act syncs the compute stream, so the pinned buffer's
        previous upload (enqueued there a step ago) is done before it is written again."""
        routed = stop.routed.tolist()  # the one host sync of the layer: its ids, and the guesses ahead
        n = stop.n_pairs
        guesses = [(target, routed[i * n:(i + 1) * n]) for i, target in enumerate(stop.targets, start=1)
                   ] if self.prefetch else []
        offsets = self.model.moe.host_step(stop.layer, routed[:n], guesses)
        stop.staged.numpy()[:] = offsets
        stop.offsets.copy_(stop.staged, non_blocking=True)  # on the compute stream, before the next graph

    def _capture(self) -> None:
        """Captures the step's graphs on a side stream (the eager pass before compiled every
        kernel), sharing one memory pool: tensors a graph leaves for the next stay where it put
        them, since the graphs replay in the order they were captured. Capturing runs nothing:
        only the caches' lengths, which the model's forward advances, are put back."""
        lengths = self.inputs.lengths
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does: cached blocks back, for the pool to take
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                self.graphs = [torch.cuda.CUDAGraph()]
                self.graphs[0].capture_begin(self.pool)
                self._open = self.graphs[0]
                try:
                    self.logits = self._pass(capture=True)
                except BaseException:
                    if self._open is not None:  # the stream's capture ends, whatever state it is in
                        with contextlib.suppress(RuntimeError):
                            self._open.capture_end()
                    raise
                self._open.capture_end()
        except RuntimeError as exc:  # an operation CUDA cannot capture, or no memory for the graphs: the step has run
            self.graphs, self.logits, self.failed = [], None, exc
        finally:
            self._open = None
            self.inputs.lengths = lengths
            current.wait_stream(side)


@dataclass
class _Ahead:
    """What a table step's pass copies ahead for served layer `layer` (TableDecode._copy_ahead),
    and the side stream's events: the guesses made, the copies done."""
    layer: int
    slots: AheadSlots
    guessed: torch.cuda.Event | None = None  # on the GPU
    copied: torch.cuda.Event | None = None


class TableDecode:
    """A decode step over the expert cache as one CUDA graph, for a step expected to find every
    expert it selects in VRAM or kept in expertd's RAM tier: each MoE layer looks its experts'
    offsets up in the cache's device table (ExpertCache.table) instead of stopping for the host,
    copies the kept ones into its transit slots (ops.expert_lookup), and records ids and offsets.
    After the replay one copy brings the record to the host. An absent expert (offset -1; the
    kernels read slot 0 instead, so nothing reads outside the cache) means the step's logits are
    not kept: `step` returns None and puts the sequences' lengths back, and the engine runs the
    token again through SegmentedDecode (or eagerly), which fetches it and writes every position
    the discarded pass wrote. So only models whose steps write nothing else take it: no states
    updated in place (`usable`). A step that found everything tells the cache which experts it
    used (its policy's touches). On the CPU nothing is captured: the same lookups run in an
    eager pass.

    A prompt of `tokens` tokens (logits of its last `last`), or a batched step (a list of
    caches, a token each), runs the same way (and eagerly, a BatchKV's runs: Engine.mixed_step),
    as static shapes (a graph per prompt length or set of slots, `capture`) or eagerly with
    `static` off (a long prompt), except that it takes
    experts from the VRAM slots only: the transit slots hold one token's k, so a pass that needs
    a kept block is run again the usual way, as one that needs an absent expert is. Where the
    cache holds every expert that is never: a prompt or a batch costs a few launches a layer
    instead of the host's work per expert (engine._table_prompt, engine._batch_step).

    With the lookahead on (the engine's prefetch) over a cache that keeps RAM-tier blocks
    (ExpertCache.n_transit has room for them), a decode step also copies ahead: after each served
    layer's lookup, a side stream guesses the next served layer's experts (its router on this
    layer's router input, lookahead.guess) and copies the guessed kept blocks into ahead slots
    (ops.expert_ahead) while the layer computes; the next layer's lookup waits for that stream and
    reads the kept blocks it guessed right from there, copying only the others. The layers' kept
    blocks then cross PCIe beside the compute rather than between it, and what each layer reads is
    still what its own routing picks: a wrong guess costs PCIe time, never a different byte.
    ExpertCache.ahead_counts says how many kept pairs were read ahead."""

    def __init__(self, model: Model, cache: KVCache | list[KVCache] | BatchKV, device: torch.device, tokens: int = 1,
                 last: int | torch.Tensor = 0, pool: object = None, capture: bool | None = None,
                 static: bool = True) -> None:
        if isinstance(cache, BatchKV) and (static or capture):
            raise ValueError("runs of several sequences' tokens (a mixed step) take the table eagerly only")
        self.model, self.cache, self.device = model, cache, device
        self.caches = cache if isinstance(cache, list) else cache.caches if isinstance(cache, BatchKV) else [cache]
        self.tokens = (len(self.caches) if isinstance(cache, list) else sum(cache.counts) if isinstance(cache, BatchKV)
                       else tokens)
        self.last, self.static = last, static
        self.transit = self.tokens == 1  # one token's k: the kept blocks through the transit slots
        self.source: ExpertCache = model.moe.source
        self.ahead = self.transit and self.copies_ahead(model)  # one token's k only: its ahead slots hold k
        self._ahead_stream = (torch.cuda.Stream(device, priority=-1) if self.ahead and device.type == "cuda"
                              else None)  # high priority: its loads wait on PCIe, let them start
        self._ahead: _Ahead | None = None  # what this pass copies ahead for the next served layer
        self._held: list[object] = []  # what the side stream reads or records, alive as long as the graph
        # A decode step's record, not a prompt's, may be left on the device (found_on_device): a
        # prompt's T*k pairs a step would make the owed records' ring as long as the prompt.
        self.decode = self.tokens == 1 or isinstance(cache, list)
        self._index = {layer: i for i, layer in enumerate(self.source.served)}
        pairs = self.tokens * self.source.manifest.model.n_expert_used
        self.record = torch.zeros(2, len(self._index), pairs, dtype=torch.int64, device=device)  # ids, offsets
        self.graph: DecodeGraph | None = None
        self.inputs: StaticInputs | None = None  # an eager static pass's
        self.staged: torch.Tensor | None = None  # the record's copy on the host, for a replay (pinned)
        if device.type == "cuda" if capture is None else capture:
            self.staged = torch.zeros(2, len(self._index), pairs, dtype=torch.int64, pin_memory=device.type == "cuda")
            with self._looking_up():
                self.graph = DecodeGraph(model, cache, device, tokens, last, pool)
        elif static:
            self.inputs = StaticInputs(cache, tokens, device)

    @property
    def buffers(self) -> tuple[tuple[int, int], ...]:
        """What the graph was captured over (buffers_of), or the caches' buffers now (eager)."""
        return self.graph.buffers if self.graph is not None else buffers_of(self.caches)

    @staticmethod
    def copies_ahead(model: Model) -> bool:
        """Whether a decode step captured now copies the next layer's guessed kept blocks ahead:
        with the lookahead on (a prefetching source and the model's router to guess with) over a
        cache with room for the ahead slots (one that may keep RAM-tier blocks and evict)."""
        moe, source = model.moe, model.moe.source
        return (moe.prefetching and moe.router is not None
                and source.n_transit >= AHEAD_TRANSIT * source.manifest.model.n_expert_used)

    @staticmethod
    def usable(model: Model, cache: KVCache | list[KVCache]) -> bool:
        """Whether a step's pass can be discarded: it updates no state in place (KDA's, DeepSeek-V4's)."""
        caches = cache if isinstance(cache, list) else [cache]
        return isinstance(model.moe.source, ExpertCache) and not any(c.state_tensors() for c in caches)

    @contextlib.contextmanager
    def _looking_up(self):
        """The model's MoE layers stop at _lookup for the passes run inside."""
        moe = self.model.moe
        moe.boundary = self._lookup
        try:
            yield
        finally:
            moe.boundary = None

    def _lookup(self, layer: int, ids: torch.Tensor, x: torch.Tensor) -> ExpertRows:
        """ExpertFFN's boundary: the layer's offsets from the table, recorded with its ids; the
        kept blocks copied ahead for it read from there, and the next layer's copied ahead (`x`:
        the layer's router input)."""
        i = self._index[layer]
        source = self.source
        if not self.transit:
            offsets = slot_lookup(ids, source.table[layer], self.record[0, i], self.record[1, i], source.slots_end)
            return ExpertRows(source.memory, offsets)
        ahead = self._ahead if self._ahead is not None and self._ahead.layer == i else None
        self._ahead = None
        current = torch.cuda.current_stream(self.device) if self._ahead_stream is not None else None
        if ahead is not None and current is not None:
            current.wait_event(ahead.guessed)  # the lookup reads the guesses; the copies may still run
        offsets = self.model.moe.ops.expert_lookup(ids, source.table[layer], self.record[0, i], self.record[1, i],
                                                   source.memory, source.slots_end, source.slot_bytes,
                                                   source.layout(layer).payload_bytes,
                                                   None if ahead is None else ahead.slots)
        if ahead is not None and current is not None:
            current.wait_event(ahead.copied)  # the side stream joins: the layer's kernels read its copies
        if self.ahead and i + 1 < len(source.served):
            self._copy_ahead(i + 1, x)
        return ExpertRows(source.memory, offsets)

    def _copy_ahead(self, j: int, x: torch.Tensor) -> None:
        """Served layer j's guessed kept blocks into its ahead slots, on the side stream (forked
        behind this layer's lookup, joined at j's): the guess from `x` by j's router, then the
        copies. Two sets of ahead slots after the transit slots, by j's parity, so that copies for
        j never overwrite what layer j-1's kernels read. The lookup at j tells which guesses were
        copied from the same table row the copies read: the table changes only between steps
        (ExpertCache._set_table, on the compute stream), never during a pass."""
        source, moe = self.source, self.model.moe
        target = source.served[j]
        stream = self._ahead_stream
        k = source.manifest.model.n_expert_used
        base = source.slots_end + (1 + j % 2) * k * source.slot_bytes
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            slots = AheadSlots(moe.guess(target, x).reshape(-1).contiguous(), base, source.ahead_counts, AHEAD_BLOCKS)
            assert slots.guess.numel() == k, "a decode step's guess is one token's k experts: its ahead slots"
            ahead = _Ahead(j, slots)
            if stream is not None:
                ahead.guessed, ahead.copied = torch.cuda.Event(), torch.cuda.Event()
                ahead.guessed.record(stream)
            moe.ops.expert_ahead(source.table[target], slots, source.memory, source.slots_end, source.slot_bytes,
                                 source.layout(target).payload_bytes)
            if stream is not None:
                ahead.copied.record(stream)
        if stream is not None:  # the allocator must not hand these to the compute stream while the side reads them
            self._held += [x, ahead]
        self._ahead = ahead

    def step(self, tokens: int | list[int]) -> torch.Tensor | None:
        """The logits after `tokens` (a decode step's token, the prompt's, or each sequence's of a
        batch), or None (the sequences as before) where an expert was absent, or for a prompt or
        batch, not in a VRAM slot."""
        lengths = [c.length for c in self.caches]
        self.source.check_session()
        if self.graph is not None:
            logits = self.graph.step(tokens)
            if self.decode and self.source.holds_every_expert:  # nothing can be absent: go on without looking
                self.source.found_on_device(self.record)
                return logits
            self.staged.copy_(self.record, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            record = self.staged
        else:
            with self._looking_up():
                if self.inputs is not None:
                    self.inputs.write(tokens)
                    with self.inputs.entered() as kv:
                        logits = self.model.forward(self.inputs.token, kv, self.last).to(torch.float32)
                else:
                    ids = [tokens] if isinstance(tokens, int) else tokens
                    logits = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=self.device),
                                                self.cache, self.last).to(torch.float32)
            record = self.record
            if self.decode and self.source.holds_every_expert:
                self.source.found_on_device(record)
                return logits
        at = record[1]
        if bool((at == -1).any() if self.transit else ((at < 0) | (at >= self.source.slots_end)).any()):
            for c, length in zip(self.caches, lengths):
                c.length = length
            return None
        self.source.found(record[0].tolist(), at.tolist())
        return logits


def slot_lookup(ids: torch.Tensor, row: torch.Tensor, rec_ids: torch.Tensor, rec_offsets: torch.Tensor,
                slots_end: int) -> torch.Tensor:
    """ops.expert_lookup for a prompt's experts `ids` [T, k], without transit: records ids and
    offsets as it does, and returns the offsets of the ones in VRAM slots ([0, slots_end)) as they
    are, 0 for the others (a pass the host drops reads only the cache). A few launches, no sync."""
    inside = ids.reshape(-1).clamp(0, row.shape[0] - 1)  # past an absent expert the routing may read NaN
    rec_ids.copy_(inside)
    torch.index_select(row, 0, inside, out=rec_offsets)
    return torch.where((rec_offsets >= 0) & (rec_offsets < slots_end), rec_offsets, 0)
