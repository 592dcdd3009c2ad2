"""Prefill and decode over one model and one KV cache: logits for a prompt, then one token at a
time, greedy or sampled. No HTTP, no daemon: the expert source decides where experts come from."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from expertpack.packtools.layout import Manifest

from ..experts.cache_policy import CacheTooSmall
from ..experts.daemon_link import DaemonLink
from ..experts.expert_cache import ExpertCache
from ..experts.split_experts import CacheGroup, SplitExperts
from ..models import Model, model_module
from ..nn.layers import BatchKV, KVCache
from ..nn.placement import Placement, parse_devices, plan
from ..weights.model_files import ModelFiles, PackExperts, ResidentExperts, expert_layers, open_model
from .arena import KVArena, Sequence
from .graphs import DecodeGraph, SegmentedDecode, StaticInputs, TableDecode, buffers_of
from .sampling import Sampler


log = logging.getLogger("expert-worker")

MIN_STATIC_CAPACITY = 512  # positions a GPU decode step's KV cache is reserved for, at least
# A generation's prompt of up to this many tokens takes the decode step's static shapes, and with
# every expert resident on CUDA replays a graph captured at the first prompt of its length: its
# launches from Python cost more than its kernels at tens of tokens (BENCHMARKS.md, pp32).
STATIC_PROMPT_MAX_TOKENS = 64
# ... while its reservation holds at most this many positions: beyond, its attention over the whole
# reservation (torch's, above layers.DECODE_MAX_QUERIES queries) would cost more than its launches.
STATIC_PROMPT_MAX_CAPACITY = 4096
# Long prompts (eager shapes) a warm-up runs, so that a request's prompt compiles no kernel. Which
# kernels and variants a length takes depends on the MoE paths' thresholds (moe.fused_path: tiles,
# then dense from 6 pairs an expert), on block sizes that grow with the prompt, and on what Triton
# compiles apart (a length, and its pair count, divisible by 16 or not): every length up to twice
# the static prompts' (where the paths change), then a few of each class in each doubling above.
WARM_UP_LONG_PROMPTS = (tuple(range(STATIC_PROMPT_MAX_TOKENS + 1, 2 * STATIC_PROMPT_MAX_TOKENS + 1))
                        + tuple(n + d for n in (2 * STATIC_PROMPT_MAX_TOKENS, 4 * STATIC_PROMPT_MAX_TOKENS,
                                                8 * STATIC_PROMPT_MAX_TOKENS) for d in (1, 2, 4, 8, 16, n)))
# Over the expert cache, a decode step runs from the device table (one graph, no host stop) while
# fewer than this share of recent steps needed a fetch: a step that finds an expert absent is run
# twice (its table pass dropped, then in segments), one that finds all of them is 2-3x faster.
TABLE_MISS_SHARE = 0.5
MISS_FADE = 0.75  # the weight of the steps before in that share, per step
# Batched decode steps kept captured (a set of slots' step over the device table, and in segments,
# count one each): a batch's composition changes as its requests come and go (slots are taken
# lowest first, so a steady batch keeps its set). The warm-up captures the sets of the lowest
# slots, up to WARM_BATCH at once.
BATCH_GRAPHS = 32
WARM_BATCH = 16


class BatchUnsupported(ValueError):
    """A batched decode step asked of a model whose forward runs one sequence at a time."""


@dataclass
class Engine:
    model: Model
    files: ModelFiles
    device: torch.device  # where the tokens go in: the first of place.devices
    place: Placement
    graphs: bool = True  # capture decode steps as CUDA graphs (split at the MoE layers with the expert cache)
    prompt_graphs: bool = True  # capture short prompts as CUDA graphs (off after a capture failed)
    table_steps: bool = True  # over the expert cache, steps run as one graph while few recent ones missed
    arena: KVArena = field(default_factory=KVArena, repr=False)
    # slot -> its decode step's graphs; (slot, prompt length) -> a short prompt's graph. A slot's
    # graphs read its buffers, as they were when _captured_at[slot] was noted.
    _graphs: dict[int, "DecodeGraph | SegmentedDecode"] = field(default_factory=dict, repr=False)
    _prompt_graphs: dict[tuple[int, int], DecodeGraph] = field(default_factory=dict, repr=False)
    _prompt_pool: object = field(default=None, repr=False)  # the memory pool the prompt graphs share
    _captured_at: dict[int, tuple] = field(default_factory=dict, repr=False)  # slot -> graphs.buffers_of
    # slot -> its decode step as one graph over the expert cache's device table, tried while few
    # recent steps needed a fetch (_found_all); SegmentedDecode runs the token where it did not
    _table_graphs: dict[int, TableDecode] = field(default_factory=dict, repr=False)
    # (slot, prompt length) -> a short prompt as one graph over the device table (_table_prompt)
    _table_prompts: dict[tuple[int, int], TableDecode] = field(default_factory=dict, repr=False)
    # (kind, slots of a batched step) -> its graphs (_batch_graph), oldest use first, in one memory pool
    _batch_graphs: "OrderedDict[tuple[type, tuple[int, ...]], DecodeGraph | TableDecode | SegmentedDecode]" = field(
        default_factory=OrderedDict, repr=False)
    _batch_pool: object = field(default=None, repr=False)
    _found_all: bool = field(default=False, repr=False)
    _miss_share: float = field(default=TABLE_MISS_SHARE, repr=False)  # fading share of recent steps that fetched

    @classmethod
    def load(cls, path: Path | str, device: str = "cpu", resident_experts: bool = False,
             daemon: str | None = None, cache_bytes: int = 0, reserve_bytes: int = 0,
             name: str = "expert-worker", daemon_timeout_s: float = 30.0, down_timeout_s: float = 60.0,
             prefetch: bool = True) -> "Engine":
        """Experts come from: the pack or GGUF directly (default), every expert on the device
        (resident_experts), or a device cache of `cache_bytes` fed by expertd at `daemon` (path
        must then be the pack the daemon serves: the fingerprints are checked at HELLO). A request
        the daemon leaves unanswered for daemon_timeout_s counts as the daemon gone; the worker
        reconnects and fails with DaemonLost once it has been gone for down_timeout_s.

        `device`: one device, or a list (`cuda:0,cuda:1`; `cpu,cpu` in tests) over which the
        layers are split in contiguous ranges (placement.py); each device then holds its layers'
        experts: their resident tables, or an expert cache of its own. A GPU's cache takes
        min(cache_bytes, its free memory - reserve_bytes); CPU devices share cache_bytes evenly.

        `prefetch`: with a daemon, each MoE layer first sends the experts the next layers will
        likely miss (lookahead.py, prefetch.py); the logits are the same bits either way."""
        files = open_model(path)
        place = plan(files, parse_devices(device, torch.cuda.device_count()))
        dev = place.first
        if daemon is not None and not isinstance(files.experts, PackExperts):
            raise ValueError(f"{path}: a daemon serves packs; give the pack directory, not a GGUF")
        moe_layers = expert_layers(files)
        n_layer = int(files.metadata[f"{files.arch}.block_count"])
        parts = [([l for l in ranged if l in moe_layers], d) for ranged, d in zip(place.ranges(n_layer), place.devices)]
        parts = [(layers, d) for layers, d in parts if layers]  # a range of dense layers reads no expert
        if resident_experts:
            on_disk = files.experts
            if place.split:
                files.experts = SplitExperts([(layers, ResidentExperts(on_disk, {l: moe_layers[l] for l in layers}, d))
                                              for layers, d in parts])
            else:
                files.experts = ResidentExperts(on_disk, moe_layers, dev)
            on_disk.close()
        model = model_module(files.arch).Model(files, place)
        # The placed tensors only from now on: the bytes read from the file go (on GPUs the whole
        # trunk's host copy, 0.86 GiB for Q3-12L, the embedding's pinned copy kept instead)
        files.trunk = dict(model.w)
        if place.ops.kernels:  # what the kernels cannot run is refused now, not at the first token
            model.moe.prepare(sorted(moe_layers))
        if daemon is not None:  # after the trunk is on the devices: each cache takes what its device has left
            link = DaemonLink(daemon, files.fingerprint, place.devices, name=name, timeout_s=daemon_timeout_s,
                              down_timeout_s=down_timeout_s)
            try:
                manifest = files.experts.manifest
                if place.split:
                    share = cache_bytes // len(place.devices) if dev.type == "cpu" else cache_bytes
                    pending: deque = deque()  # the link's staging slots whose copy may still run, any device's
                    cache = CacheGroup([(layers, _device_cache(manifest, link, d, share, reserve_bytes, layers, pending,
                                                               len(place.devices)))
                                        for layers, d in parts])
                    for part in cache.caches:  # the session's kept RAM-tier blocks, shared alike
                        part.keep_share = 1 / len(cache.caches)
                else:
                    cache = ExpertCache(manifest, link, dev, cache_bytes, reserve_bytes)
            except BaseException:
                link.close()
                raise
            files.experts.close()  # the daemon reads the pack from now on
            files.experts = model.moe.source = cache
            model.moe.prefetch = prefetch
        return cls(model, files, dev, place)

    @property
    def static_steps(self) -> bool:
        """Whether decode steps and short prompts take static shapes (and CUDA graphs, where the
        graphs are on): where the kernels run, which read positions on the device, for models
        whose steps keep their shapes."""
        return self.place.ops.kernels and self.model.static_decode

    @property
    def layer_ranges(self) -> tuple[range, ...]:
        """The layers each of place.devices runs, in order."""
        return self.place.ranges(int(self.files.metadata[f"{self.files.arch}.block_count"]))

    @property
    def expert_cache(self) -> ExpertCache | CacheGroup | None:
        source = self.model.moe.source
        return source if isinstance(source, (ExpertCache, CacheGroup)) else None

    def close(self) -> None:
        """Waits for the cache's copies, gives the staging back and leaves the daemon; closes the
        files experts are read from."""
        self._drop_graphs()
        self.files.experts.close()

    def new_sequence(self) -> Sequence:
        """A sequence in the engine's arena: the handle a request holds (close it when done)."""
        return self.arena.open()

    def kv_bytes_per_position(self) -> dict[torch.device, float]:
        """Bytes a sequence's KV memory takes per position on each device, for the models with
        batched steps (Model.kv_position_bytes, by layer: keys and values, or DeepSeek-V4's
        compressed entries). Worked out, not measured on a step: a step reads experts, which a
        damaged pack may fail."""
        per: dict[torch.device, float] = {}
        for device, layers in zip(self.place.devices, self.layer_ranges):  # `cpu,cpu` (tests): one device
            per[device] = per.get(device, 0) + sum(self.model.kv_position_bytes[i] for i in layers)
        return per

    @property
    def batch_graphs(self) -> int:
        """Batched decode steps held captured (one per set of slots)."""
        return len(self._batch_graphs)

    @torch.inference_mode()
    def warm_up(self, token: int, steps: int = 8, batch: int = 1) -> int:
        """Does what would make the first requests slow before they come: the kernels compiled for
        a decode step and for short and long prompts, the decode step's graphs captured (in
        segments, then over the expert table once a step has found every expert), and, where
        prompts are captured (every expert resident on CUDA, or every expert in the cache's VRAM
        slots), a graph for every static prompt length. All in slot 0, where a server's one request
        at a time runs; the long prompts in slot 1, so that their buffers do not widen slot 0's
        reservation. With `batch` > 1 (a server's --max-batch), the batched steps of slots 0..b-1
        for each b up to it (at most WARM_BATCH), the sets a steady batch runs in, since slots
        are taken lowest first. The logits are thrown away. Returns how many prompt graphs it
        captured."""
        with self.new_sequence() as seq:
            for _ in range(1 + steps):
                self.forward([token], seq)
            with self.new_sequence() as other:  # a short prompt where not captured, then eager shapes
                self.forward([token] * 5, other, last=True)
                n_ctx = int(self.files.metadata.get(f"{self.files.arch}.context_length", 4096))
                compiled = WARM_UP_LONG_PROMPTS if self.place.ops.kernels else ()  # torch's path compiles nothing
                for n in (n for n in compiled if n <= n_ctx):
                    other.kv.clear()
                    self.forward([token] * n, other, last=True)
        if batch > 1 and getattr(self.model, "batched_decode", False):
            with contextlib.ExitStack() as open_:
                seqs = [open_.enter_context(self.new_sequence()) for _ in range(min(batch, WARM_BATCH))]
                for seq in seqs:
                    self.forward([token], seq)
                for b in range(2, len(seqs) + 1):
                    self.decode_batch(seqs[:b], [token] * b)
        if (self.device.type != "cuda" or not self.prompt_graphs or not self.static_steps
                or not self.model.static_prompt or self.place.split):
            return 0
        with self.new_sequence() as seq:
            if not (self._replayed_kind() is DecodeGraph or self._prompt_from_table(seq.kv)):
                return 0
        before = len(self._prompt_graphs) + len(self._table_prompts)
        for t in range(2, STATIC_PROMPT_MAX_TOKENS + 1):
            with self.new_sequence() as seq:
                self.forward([token] * t, seq, last=True)
        return len(self._prompt_graphs) + len(self._table_prompts) - before

    @torch.inference_mode()
    def forward(self, tokens: list[int], seq: Sequence, last: bool = False) -> torch.Tensor:
        """Logits [len(tokens), n_vocab] (float32) after each token, continuing the sequence; with
        `last`, [1, n_vocab] after the last token only (what a generation's prefill needs)."""
        cache = seq.kv
        with self.place.running():
            if self.static_steps:
                # a one-token prompt too, into a slot that has its buffers (and no states to start)
                if len(tokens) == 1 and (cache.length or (cache.keys and not cache.state)):
                    return self._static_step(tokens[0], seq.slot, cache)
                if (last and 1 < len(tokens) <= STATIC_PROMPT_MAX_TOKENS and self.model.static_prompt
                        and not self.place.split and self._reserve_for_prompt(cache, len(tokens))):
                    return self._static_prompt(tokens, seq.slot, cache)
            if len(tokens) > 1 and self._prompt_from_table(cache):
                logits = self._table_prompt(tokens, seq.slot, cache, last, static=False)
                if logits is not None:
                    return logits
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, cache, last).to(torch.float32)

    @torch.inference_mode()
    def decode_batch(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """One decode step of several sequences together, continuous batching's step: row i of the
        logits [len(seqs), n_vocab] (float32) follows tokens[i], the next token of seqs[i]. The
        matrices and the experts run on every row at once (a layer's experts read once for the
        union of the rows' picks), each row's attention in its own sequence; for the
        architectures whose models take a BatchKV (Model.batched_decode).

        Where decode steps take static shapes (the kernels' path) the step does too, each row
        attending its slot's reserved buffers (_static_batch): on CUDA a graph per set of slots,
        captured at the first step of that set, over every expert resident or over the expert
        cache's device table while recent steps found their experts there; a step whose experts
        are not all in VRAM runs in segments between the MoE layers (SegmentedDecode: the host
        fetches a layer's missing experts for all rows at once), or eagerly where the rows' picks
        may not fit the cache in one wave. A row's logits equal that sequence's own
        step's within float32 rounding: the torch path multiplies all rows in one matrix product,
        and on a GPU the experts' kernel splits gate/up's K by the step's pairs
        (moe_tl.gate_up_splits), so a row's sums may be ordered otherwise than alone. Bit for bit
        where neither applies (the kernels under Triton's interpreter on one-chunk experts:
        tests/worker/test_batched_decode.py)."""
        if not getattr(self.model, "batched_decode", False):
            raise BatchUnsupported(f"{self.files.arch}: its model runs one sequence a step; batched decode steps are "
                                   "written for qwen3moe, qwen2moe, llama (Mixtral), gpt-oss and deepseek4 so far")
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError(f"a batched step takes a token for each sequence: {len(seqs)} sequences, {len(tokens)} "
                             "tokens")
        with self.place.running():
            if self.static_steps and not self.place.split:
                return self._static_batch(seqs, tokens)
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, BatchKV([s.kv for s in seqs])).to(torch.float32)

    def mixes(self, seqs: list[Sequence]) -> bool:
        """Whether these sequences' tokens can run in one step, pieces of prompts beside next
        tokens (mixed_step): for the models of batched steps whose sequences keep no states of
        their own (KDA's, DeepSeek-V4's compressed ones, which a static step updates in place and
        an eager pass would have to take over)."""
        return (getattr(self.model, "batched_decode", False) and len(seqs) > 1
                and not any(s.kv.state for s in seqs))

    @torch.inference_mode()
    def mixed_step(self, pieces: list[tuple[Sequence, list[int]]], seqs: list[Sequence], tokens: list[int]
                   ) -> torch.Tensor:
        """Pieces of prompts (each sequence's next tokens of its prompt) and the next token of each
        of `seqs` (none or more) in one pass: prompts admitted together run as one, reading a
        layer's experts once for every row's picks (expert-worker's scheduler; serve/batching.py
        says why it keeps its running sequences' tokens out). -> logits [len(pieces) + len(seqs),
        n_vocab] (float32): row i after the last token of pieces[i], then one row after each of
        `tokens`.

        Eager (the pieces' lengths vary), each sequence's attention over its own cache (BatchKV
        runs). Over the expert cache's device table where a prompt would take it (_prompt_from_table:
        no host stop per layer), else through the expert source. Rows are computed as a prompt's
        are, so a running sequence's logits equal its own decode step's within float32 rounding,
        as a batched step's do (decode_batch)."""
        prompts = [seq for seq, _ in pieces]
        if len(seqs) != len(tokens) or not pieces or not all(piece for _, piece in pieces) or (
                len({id(s) for s in prompts + seqs}) != len(prompts) + len(seqs)):
            raise ValueError(f"a mixed step takes pieces of prompts of sequences of their own and a token for each of "
                             f"the {len(seqs)} other sequences: pieces of {[len(p) for _, p in pieces]} tokens, "
                             f"{len(tokens)} tokens")
        if not self.mixes(prompts + seqs):
            raise BatchUnsupported(f"{self.files.arch}: prompt pieces run beside other sequences' steps only for "
                                   "models of batched steps whose sequences keep no states of their own")
        counts = [len(piece) for _, piece in pieces] + [1] * len(seqs)
        kv = BatchKV([s.kv for s in prompts + seqs], counts=counts)
        ends = torch.tensor(counts).cumsum(0) - 1  # each run's last row: the rows whose logits are read
        ids = [t for _, piece in pieces for t in piece] + list(tokens)
        with self.place.running():
            last = ends.to(self.device)
            if self._prompt_from_table(prompts[0].kv) and TableDecode.usable(self.model, kv.caches):
                logits = TableDecode(self.model, kv, self.device, last=last, capture=False, static=False).step(ids)
                if logits is not None:
                    return logits
                self._note_step(missed=True)
            return self.model.forward(torch.tensor(ids, dtype=torch.int64, device=self.device), kv, last
                                      ).to(torch.float32)

    def _static_batch(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """A batched step with static shapes, every cache reserved as a one-sequence step reserves
        it: replayed where a graph of these slots can run (_batch_graph), else eagerly (through
        the expert source, which fetches what is missing). The same bits either way. Rows run in
        their slots' order (a set of slots has one graph, whatever order its requests came in)."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)  # one graph for a set of slots, in any order
        if order != list(range(len(seqs))):
            logits = self._static_batch([seqs[i] for i in order], [tokens[i] for i in order])
            back = torch.empty(len(order), dtype=torch.int64)
            back[order] = torch.arange(len(order))
            return logits[back.to(logits.device)]
        caches = [s.kv for s in seqs]
        for cache in caches:
            capacity = _static_capacity(cache.length, cache.capacity)
            if capacity != cache.capacity:
                cache.reserve(capacity)
        kind = self._replayed_kind()
        slots = tuple(s.slot for s in seqs)
        if kind is DecodeGraph:
            with self._padded(slots, caches, tokens) as (p_slots, p_caches, p_tokens, rows):
                graph = self._batch_graph(DecodeGraph, p_slots, p_caches)
                if graph is not None:
                    return graph.step(p_tokens)[rows]
        fetches = self.files.experts.fetches if kind is SegmentedDecode else 0
        noted = False  # a pass over the table that found an expert absent counts the step as missed
        if kind is SegmentedDecode and self.table_steps and self._found_all and TableDecode.usable(self.model, caches):
            with self._padded(slots, caches, tokens) as (p_slots, p_caches, p_tokens, rows):
                table = self._batch_graph(TableDecode, p_slots, p_caches)
                logits = table.step(p_tokens) if table is not None else None
            if logits is not None:
                self._note_step(missed=False)
                return logits[rows]
            if table is not None:  # an expert was not in VRAM (a kept RAM-tier block is not read by batches)
                self._note_step(missed=True)
                noted = True
        if kind is SegmentedDecode and SegmentedDecode.fits(self.model, len(caches)):
            segmented = self._batch_graph(SegmentedDecode, slots, caches)
            if segmented is not None:
                logits = segmented.step(tokens)
                if not noted:
                    self._note_step(missed=self.files.experts.fetches != fetches)
                if segmented.failed is not None:
                    log.warning("batched decode step not captured as CUDA graphs (%s); running it eagerly",
                                segmented.failed)
                    self._drop_graphs()
                    self.graphs = False
                return logits
        inputs = StaticInputs(caches, len(caches), self.device)
        inputs.write(tokens)
        with inputs.entered() as kv:
            logits = self.model.forward(inputs.token, kv).to(torch.float32)
        if kind is SegmentedDecode and not noted:
            self._note_step(missed=self.files.experts.fetches != fetches)
        return logits

    @contextlib.contextmanager
    def _padded(self, slots: tuple[int, ...], caches: list[KVCache], tokens: list[int]
                ) -> Iterator[tuple[tuple[int, ...], list[KVCache], list[int], torch.Tensor | slice]]:
        """The step's rows widened to the slots 0..max(slots), the sets warm_up captures: slots,
        caches and tokens of the widened step, and which of its rows are the step's. A batch of
        slots {0, 1, 3} (slot 2's request done, or its prompt still running) then replays the graph
        of {0, 1, 2, 3} rather than capturing one of its own, which would cost more than the idle
        row: a decode step of a few rows is bound by its launches, not its arithmetic. An idle row
        writes its keys and values at its slot's length (clamped into the buffers), which the
        slot's next sequence or next prompt piece writes before anything attends it, and its length
        is put back after. Only where every idle slot has buffers of a static step; else the
        step's own slots. Each real row's arithmetic is its own (BatchKV), so its logits are the
        unwidened step's within the same float32 rounding a batch already allows."""
        idle = [s for s in range(slots[-1] + 1) if s not in slots]
        idle_caches = [self.arena.slots[s] for s in idle]
        if not idle or any(not c.keys or c.capacity < 1 for c in idle_caches):
            yield slots, caches, tokens, slice(None)
            return
        lengths = [c.length for c in idle_caches]
        for c in idle_caches:
            c.length = min(c.length, c.capacity - 1)
        by_slot = dict(zip(slots, caches)) | dict(zip(idle, idle_caches))
        token_of = dict(zip(slots, tokens))
        full = tuple(range(slots[-1] + 1))
        rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        try:
            yield full, [by_slot[s] for s in full], [token_of.get(s, tokens[0]) for s in full], rows
        finally:
            for c, length in zip(idle_caches, lengths):
                c.length = length

    def _batch_graph(self, kind: "type[DecodeGraph] | type[TableDecode] | type[SegmentedDecode]",
                     slots: tuple[int, ...], caches: list[KVCache]) -> "DecodeGraph | TableDecode | SegmentedDecode | None":
        """The batched step of these slots as graphs of `kind` (on the CPU TableDecode and
        SegmentedDecode run their passes eagerly), captured at their first step and kept while the
        slots' buffers stay (BATCH_GRAPHS at most, the least recently used dropped first; all in
        one memory pool, since they never run at once). None where capture failed (the step then
        runs eagerly, and so do the later ones)."""
        graph = self._batch_graphs.pop((kind, slots), None)
        if graph is not None and (graph.buffers != buffers_of(caches)
                                  or getattr(graph, "prefetch", self.model.moe.prefetch) != self.model.moe.prefetch):
            graph = None
        if graph is None and kind is TableDecode and self.device.type != "cuda":
            return TableDecode(self.model, caches, self.device, capture=False)
        if graph is None:
            while len(self._batch_graphs) >= BATCH_GRAPHS:
                self._batch_graphs.pop(next(iter(self._batch_graphs)))
            if self._batch_pool is None and self.device.type == "cuda":
                self._batch_pool = torch.cuda.graph_pool_handle()
            try:
                graph = kind(self.model, caches, self.device, pool=self._batch_pool)
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # an operation CUDA cannot capture: the next way down, from now on
                if kind is TableDecode:  # segments, as one sequence's steps do
                    log.warning("batched decode step over the expert table not captured (%s); stepping in "
                                "segments", exc)
                    self.table_steps = False
                    return None
                log.warning("batched decode step not captured as a CUDA graph (%s); running it eagerly", exc)
                self.graphs = False
                self._drop_graphs()
                return None
        self._batch_graphs[(kind, slots)] = graph  # the most recently used last
        return graph

    def _drop_graphs(self, slot: int | None = None) -> None:
        """A slot's graphs (every slot's without one) and their memory go, before a new capture."""
        slots = list(self._captured_at) if slot is None else [slot]
        for s in slots:
            self._graphs.pop(s, None)
            self._table_graphs.pop(s, None)
            self._captured_at.pop(s, None)
            for graphs in (self._prompt_graphs, self._table_prompts):
                for key in [k for k in graphs if k[0] == s]:
                    del graphs[key]
        for key in [k for k in self._batch_graphs if slot is None or slot in k[1]]:
            del self._batch_graphs[key]
        if not self._batch_graphs:
            self._batch_pool = None
        if not self._prompt_graphs and not self._table_prompts:
            self._prompt_pool = None

    def _current_graphs(self, slot: int, cache: KVCache) -> None:
        """Drops the slot's graphs where its buffers changed since they were captured."""
        if slot in self._captured_at and self._captured_at[slot] != buffers_of([cache]):
            self._drop_graphs(slot)

    def _reserve_for_prompt(self, cache: KVCache, t: int) -> bool:
        """Readies `cache` for a static prompt of t tokens: a reservation it has is kept where it
        holds the prompt, else it is reserved for a power of two above the prompt's end (so its
        next decode step does not outgrow it); an empty one first gets its model's states where it
        has its own (Model.new_states). False, and no reservation made, where that reservation
        would exceed STATIC_PROMPT_MAX_CAPACITY (states given are as an eager pass makes them)."""
        new_states = getattr(self.model, "new_states", None)
        if not cache.length and not cache.state and new_states is not None:
            cache.state.update(new_states())  # reserved below, as a filled cache's are
        capacity = _static_capacity(cache.length + t, cache.capacity)
        if capacity > STATIC_PROMPT_MAX_CAPACITY:
            return False
        if capacity != cache.capacity:
            cache.reserve(capacity)
        return True

    def _static_prompt(self, tokens: list[int], slot: int, cache: KVCache) -> torch.Tensor:
        """A generation's prompt of a few tokens (logits of its last) with the decode step's
        static shapes (`cache` reserved for it): keys and values written at device positions,
        attention over the reserved buffers masked by position. With every expert resident on CUDA
        it is a CUDA graph per slot and prompt length, captured at the first such prompt (two
        warm-up passes, then a capture that runs nothing) and replayed after; else the same
        operations run eagerly, so that every expert source gives the same bits."""
        t = len(tokens)
        if self.prompt_graphs and self._replayed_kind() is DecodeGraph:
            self._current_graphs(slot, cache)
            graph = self._prompt_graphs.get((slot, t))
            if graph is None:
                if self._prompt_pool is None:
                    self._prompt_pool = torch.cuda.graph_pool_handle()
                try:
                    graph = DecodeGraph(self.model, cache, self.device, t, last=True, pool=self._prompt_pool)
                except RuntimeError as exc:  # an operation CUDA cannot capture, or no memory: eagerly
                    log.warning("prompt not captured as a CUDA graph (%s); prompts run eagerly", exc)
                    self.prompt_graphs = False
                    self._prompt_graphs.clear()
                    self._prompt_pool = None
                else:
                    self._prompt_graphs[(slot, t)] = graph
                    self._captured_at[slot] = buffers_of([cache])  # an empty slot's buffers were just made
            if graph is not None:
                return graph.step(tokens)
        if self._prompt_from_table(cache):
            logits = self._table_prompt(tokens, slot, cache, True, static=True)
            if logits is not None:
                return logits
        cache.step_positions = torch.arange(cache.length, cache.length + t, dtype=torch.int64, device=self.device)
        try:
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, cache, True).to(torch.float32)
        finally:
            cache.step_positions = None

    def _prompt_from_table(self, cache: KVCache) -> bool:
        """Whether a prompt is tried as one pass over the cache's device table: where every
        expert sits in a VRAM slot (a prompt's T*k picks would otherwise seldom all be there, and
        a pass that misses one is run again), once the steps before found theirs."""
        source = self.files.experts
        return (self.table_steps and self._found_all and isinstance(source, ExpertCache) and source.holds_every_expert
                and self.place.ops.kernels and not self.place.split and self.model.moe.routing_log is None
                and TableDecode.usable(self.model, cache))

    def _table_prompt(self, tokens: list[int], slot: int, cache: KVCache, last: bool,
                      static: bool) -> torch.Tensor | None:
        """A prompt as one pass over the expert table (TableDecode): with the static shapes
        (`cache` reserved for it), a CUDA graph per slot and prompt length where prompts are
        captured, like a resident engine's; else eagerly. Its logits, or None where an expert was
        not in VRAM (nothing of that pass is kept; the caller runs the prompt the usual way)."""
        table = None
        if static and self.prompt_graphs and self.device.type == "cuda":
            self._current_graphs(slot, cache)
            table = self._table_prompts.get((slot, len(tokens)))
            if table is None:
                if self._prompt_pool is None:
                    self._prompt_pool = torch.cuda.graph_pool_handle()
                try:
                    table = TableDecode(self.model, cache, self.device, len(tokens), last=True, pool=self._prompt_pool)
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as exc:  # an operation CUDA cannot capture: eagerly
                    log.warning("prompt over the expert table not captured as a CUDA graph (%s); prompts run "
                                "eagerly", exc)
                    self.prompt_graphs = False
                    table = None
                else:
                    self._table_prompts[(slot, len(tokens))] = table
                    self._captured_at[slot] = buffers_of([cache])
        if table is None:
            table = TableDecode(self.model, cache, self.device, len(tokens), last, capture=False, static=static)
        logits = table.step(tokens)
        if logits is None:
            self._note_step(missed=True)
        return logits

    def _static_step(self, token: int, slot: int, cache: KVCache) -> torch.Tensor:
        """A decode step on the GPU with the same shapes at every position: the KV cache reserved
        ahead and attended whole, masked by position. With every expert resident the step is a
        CUDA graph, replayed (DecodeGraph); with the expert cache, whose misses need a host sync
        per MoE layer, a sequence of graphs split at the MoE layers (SegmentedDecode; on the CPU,
        under Triton's interpreter, the same segments run eagerly); else, or with `graphs` off,
        the same operations run eagerly. All give the same bits. Over several devices the step
        runs eagerly (one graph per device range is not written yet)."""
        capacity = _static_capacity(cache.length, cache.capacity)
        if capacity != cache.capacity:
            cache.reserve(capacity)
        kind = self._replayed_kind()
        if kind is SegmentedDecode and self.table_steps and self._found_all and TableDecode.usable(self.model, cache):
            self._current_graphs(slot, cache)
            logits = self._table_step(token, slot, cache)
            if logits is not None:
                return logits
        if kind is not None:
            self._current_graphs(slot, cache)
            graph = self._graphs.get(slot)
            if (graph is None or not isinstance(graph, kind)
                    or (isinstance(graph, SegmentedDecode) and graph.prefetch != self.model.moe.prefetch)):
                self._graphs.pop(slot, None)  # its memory goes back before the next one is captured
                try:
                    graph = self._graphs[slot] = kind(self.model, cache, self.device)
                    self._captured_at[slot] = buffers_of([cache])
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as exc:  # an operation CUDA cannot capture: the same step, eagerly
                    log.warning("decode step not captured as a CUDA graph (%s); running it eagerly", exc)
                    self.graphs = False
                    graph = None
            if graph is not None:
                fetches = self.files.experts.fetches if kind is SegmentedDecode else 0
                logits = graph.step(token)
                if kind is SegmentedDecode:
                    self._note_step(missed=self.files.experts.fetches != fetches)
                if isinstance(graph, SegmentedDecode) and graph.failed is not None:
                    log.warning("decode step not captured as CUDA graphs (%s); running it eagerly", graph.failed)
                    self._drop_graphs()
                    self.graphs = False
                return logits
        cache.step_positions = torch.full((1,), cache.length, dtype=torch.int64, device=self.device)
        if self.place.split:  # the position written on every range's device once, not copied per layer
            cache.step_copies = {d: torch.full((1,), cache.length, dtype=torch.int64, device=d)
                                 for d in self.place.devices[1:]}
        try:
            return self.model.forward(torch.full((1,), token, dtype=torch.int64, device=self.device),
                                      cache).to(torch.float32)
        finally:
            cache.step_positions = None
            cache.step_copies = {}

    def _table_step(self, token: int, slot: int, cache: KVCache) -> torch.Tensor | None:
        """The step as one graph over the cache's device table (TableDecode): its logits, or None
        where an expert was absent (nothing of that pass is kept; the caller fetches and runs it)."""
        graph = self._table_graphs.get(slot)
        if graph is not None and graph.ahead != (graph.transit and TableDecode.copies_ahead(self.model)):
            del self._table_graphs[slot]  # captured with the lookahead's copies, or without: again
            graph = None
        if graph is None:
            try:
                graph = self._table_graphs[slot] = TableDecode(self.model, cache, self.device)
                self._captured_at[slot] = buffers_of([cache])
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # an operation CUDA cannot capture: segments, as before
                log.warning("decode step over the expert table not captured (%s); stepping in segments", exc)
                self.table_steps = False
                return None
        logits = graph.step(token)
        if logits is not None:  # else the token runs in segments next, which say whether it fetched
            self._note_step(missed=False)
        return logits

    def _note_step(self, missed: bool) -> None:
        """Whether the next step tries the table: while fewer than TABLE_MISS_SHARE of the recent
        steps fetched (faded by MISS_FADE a step; one clean step after the start is enough)."""
        self._miss_share = MISS_FADE * self._miss_share + (1 - MISS_FADE) * missed
        self._found_all = self._miss_share < TABLE_MISS_SHARE

    def _replayed_kind(self) -> "type[DecodeGraph] | type[SegmentedDecode] | None":
        """How this engine's decode steps are replayed, if they are: the whole step as one graph
        (every expert resident, CUDA), or segments between the MoE layers (the expert cache)."""
        if not self.graphs or self.place.split or self.model.moe.routing_log is not None:
            return None
        source = self.files.experts
        if isinstance(source, ResidentExperts) and self.device.type == "cuda":
            return DecodeGraph
        if isinstance(source, ExpertCache) and SegmentedDecode.fits(self.model):
            return SegmentedDecode
        return None

    def generate(self, prompt: list[int], n: int, sampler: Sampler, seq: Sequence | None = None,
                 stop: set[int] = frozenset()) -> tuple[list[int], torch.Tensor]:
        """Prompt logits [len(prompt), V] and up to n new tokens (stopping after a `stop` token),
        continuing `seq` (else in a sequence of its own, closed after)."""
        with contextlib.ExitStack() as own:
            if seq is None:
                seq = own.enter_context(self.new_sequence())
            logits = self.forward(prompt, seq)
            prompt_logits = logits
            out: list[int] = []
            for _ in range(n):
                token = sampler(logits[-1])
                out.append(token)
                if token in stop or len(out) == n:
                    break
                logits = self.forward([token], seq)
        return out, prompt_logits


def _static_capacity(need: int, capacity: int) -> int:
    """The positions a static pass reserves: a power of two above `need`, at least
    MIN_STATIC_CAPACITY, so a reservation changes (and its graphs are captured anew) at doublings
    only; a slot that holds more from an earlier sequence keeps it, rounded up to a power of two."""
    want = max(MIN_STATIC_CAPACITY, 1 << need.bit_length(), capacity)
    return 1 << (want - 1).bit_length()


def _device_cache(manifest: Manifest, link: DaemonLink, device: torch.device, cache_bytes: int, reserve_bytes: int,
                  layers: list[int], pending: deque, n_devices: int) -> ExpertCache:
    """One device's expert cache of a split worker; a refusal names the device and its layers."""
    try:
        return ExpertCache(manifest, link, device, cache_bytes, reserve_bytes, layers, pending)
    except CacheTooSmall as exc:
        shared = f"; the {n_devices} CPU devices share the budget evenly" if device.type == "cpu" else ""
        raise CacheTooSmall(f"{device} (MoE layers {layers[0]}..{layers[-1]}): {exc}{shared}") from None
