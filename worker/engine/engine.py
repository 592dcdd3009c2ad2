"""Prefill and decode over one model and one KV cache: logits for a prompt, then one token at a
time, greedy or sampled. No HTTP, no daemon: the expert source decides where experts come from."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertpack.packtools.layout import Manifest

from ..experts.cache_policy import CacheTooSmall
from ..experts.daemon_link import DaemonLink
from ..experts.expert_cache import ExpertCache
from ..experts.lookahead import Guesses
from ..experts.split_experts import CacheGroup, SplitExperts
from ..models import Model, model_module
from ..nn.layers import KVCache
from ..nn.placement import Placement, parse_devices, plan
from ..weights.model_files import ExpertRows, ModelFiles, PackExperts, ResidentExperts, expert_layers, open_model
from ..weights.qtensor import use_kernels
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


@dataclass
class Engine:
    model: Model
    files: ModelFiles
    device: torch.device  # where the tokens go in: the first of place.devices
    place: Placement
    graphs: bool = True  # capture decode steps as CUDA graphs (split at the MoE layers with the expert cache)
    prompt_graphs: bool = True  # capture short prompts as CUDA graphs (off after a capture failed)
    _graph: "DecodeGraph | SegmentedDecode | None" = field(default=None, repr=False)
    # prompt length -> its graph; every graph of the engine (these and _graph) reads the same KV
    # buffers, held by one cache at a time (_bind)
    _prompt_graphs: dict[int, "DecodeGraph"] = field(default_factory=dict, repr=False)
    _prompt_pool: object = field(default=None, repr=False)  # the memory pool the prompt graphs share
    _buffers: tuple[int, ...] | None = field(default=None, repr=False)  # KVCache.buffer_ptrs the graphs read
    _verified: tuple[KVCache, int] | None = field(default=None, repr=False)  # a cache and generation found holding them

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
        if use_kernels(dev):  # what the kernels cannot run is refused now, not at the first token
            _require_triton(dev)
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

    def new_cache(self) -> KVCache:
        return KVCache()

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: KVCache, last: bool = False) -> torch.Tensor:
        """Logits [len(tokens), n_vocab] (float32) after each token, continuing the cache; with
        `last`, [1, n_vocab] after the last token only (what a generation's prefill needs)."""
        with self.place.running():
            if use_kernels(self.device) and self.model.static_decode:
                if len(tokens) == 1 and (cache.length or self._adopt_buffers(cache)):
                    return self._static_step(tokens[0], cache)
                if (last and 1 < len(tokens) <= STATIC_PROMPT_MAX_TOKENS and self.model.static_prompt
                        and not self.place.split and self._reserve_for_prompt(cache, len(tokens))):
                    return self._static_prompt(tokens, cache)
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, cache, last).to(torch.float32)

    def _adopt_buffers(self, cache: KVCache, max_capacity: int | None = None) -> bool:
        """An empty cache takes the buffers the captured graphs read (their holder keeps its rows in
        new ones), so that its first token, or a short prompt, replays a graph instead of running
        eagerly (a one-token prompt eagerly: about ten steps' time on the GPU; llama-bench's tg
        decodes from an empty cache). Caches with an architecture's own states take their shapes
        from a prompt. Not where the holder's reservation exceeds `max_capacity`."""
        holder = self._holder()
        if (holder is None or cache.keys or cache.state or holder.state or not holder.keys
                or (max_capacity is not None and holder.capacity > max_capacity)):
            return False
        cache.take_buffers(holder)
        for graph in self._captured():
            graph.cache = cache
        return True

    def _captured(self) -> list["DecodeGraph | SegmentedDecode"]:
        return ([self._graph] if self._graph is not None else []) + list(self._prompt_graphs.values())

    def _holder(self) -> KVCache | None:
        """The cache holding the buffers the captured graphs read."""
        graphs = self._captured()
        return graphs[0].cache if graphs else None

    def _drop_graphs(self) -> None:
        """Their memory goes back (before the next capture)."""
        self._graph = None
        self._prompt_graphs.clear()
        self._prompt_pool = None
        self._buffers = self._verified = None

    def _captured_over(self, cache: KVCache) -> None:
        """A graph was just captured over `cache`'s buffers, which _bind made the others' too."""
        self._buffers, self._verified = cache.buffer_ptrs(), (cache, cache.generation)

    def _bind(self, cache: KVCache) -> None:
        """Makes `cache` hold the buffers the captured graphs read, trading rows with the cache
        that held them (each keeps its own rows and states: the next request needs no new capture);
        where it cannot (another capacity or shapes), or where the buffers
        grew since the graphs were captured, the graphs are dropped, to be captured anew."""
        holder = self._holder()
        if holder is None:
            self._buffers = self._verified = None
            return
        if holder is not cache:
            if holder.capacity != cache.capacity or not cache.same_shapes(holder):
                self._drop_graphs()
                return
            cache.trade_buffers(holder)
            for graph in self._captured():
                graph.cache = cache
        verified = self._verified  # states may be replaced by a prompt without a new generation: checked always
        if self._buffers is not None and (cache.state or verified is None or verified[0] is not cache
                                          or verified[1] != cache.generation):
            if cache.buffer_ptrs() != self._buffers:
                self._drop_graphs()  # grown since, or a trade cut short: the graphs read other tensors
            else:
                self._verified = (cache, cache.generation)

    def _reserve_for_prompt(self, cache: KVCache, t: int) -> bool:
        """Readies `cache` for a static prompt of t tokens: an empty one takes the graphs' buffers
        where they allow it, else it is reserved for a power of two above the prompt's end (so its
        next decode step does not outgrow it); an empty one first gets its model's states where it
        has its own (Model.new_states). False, and no reservation made, where that reservation
        would exceed STATIC_PROMPT_MAX_CAPACITY (states given are as an eager pass makes them)."""
        if not cache.length and self._adopt_buffers(cache, STATIC_PROMPT_MAX_CAPACITY):
            return True
        new_states = getattr(self.model, "new_states", None)
        if not cache.length and not cache.state and new_states is not None:
            cache.state.update(new_states())  # reserved below, as a filled cache's are
        need = cache.length + t
        capacity = cache.capacity
        if capacity <= need or capacity < MIN_STATIC_CAPACITY or capacity & (capacity - 1):
            capacity = max(MIN_STATIC_CAPACITY, 1 << need.bit_length())  # a power of two > need
            if capacity > STATIC_PROMPT_MAX_CAPACITY:
                return False
            cache.reserve(capacity)
        return capacity <= STATIC_PROMPT_MAX_CAPACITY

    def _static_prompt(self, tokens: list[int], cache: KVCache) -> torch.Tensor:
        """A generation's prompt of a few tokens (logits of its last) with the decode step's
        static shapes (`cache` reserved for it): keys and values written at device positions,
        attention over the reserved buffers masked by position. With every expert resident on CUDA
        it is a CUDA graph per prompt length, captured at the first prompt of that length (two
        warm-up passes, then a capture that runs nothing) and replayed after; else the same
        operations run eagerly, so that every expert source gives the same bits."""
        t = len(tokens)
        if self.prompt_graphs and self._replayed_kind() is DecodeGraph:
            self._bind(cache)
            graph = self._prompt_graphs.get(t)
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
                    self._prompt_graphs[t] = graph
                    self._captured_over(cache)
            if graph is not None:
                return graph.step(tokens)
        cache.step_positions = torch.arange(cache.length, cache.length + t, dtype=torch.int64, device=self.device)
        try:
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, cache, True).to(torch.float32)
        finally:
            cache.step_positions = None

    def _static_step(self, token: int, cache: KVCache) -> torch.Tensor:
        """A decode step on the GPU with the same shapes at every position: the KV cache reserved
        ahead and attended whole, masked by position. With every expert resident the step is a
        CUDA graph, replayed (DecodeGraph); with the expert cache, whose misses need a host sync
        per MoE layer, a sequence of graphs split at the MoE layers (SegmentedDecode; on the CPU,
        under Triton's interpreter, the same segments run eagerly); else, or with `graphs` off,
        the same operations run eagerly. All give the same bits. Over several devices the step
        runs eagerly (one graph per device range is not written yet)."""
        capacity = cache.capacity
        if capacity <= cache.length or capacity < MIN_STATIC_CAPACITY or capacity & (capacity - 1):
            cache.reserve(max(MIN_STATIC_CAPACITY, 1 << cache.length.bit_length()))  # a power of two > length
        kind = self._replayed_kind()
        if kind is not None:
            self._bind(cache)  # the next request: no new capture
            graph = self._graph
            if (graph is None or not isinstance(graph, kind) or graph.cache is not cache
                    or graph.capacity != cache.capacity
                    or (isinstance(graph, SegmentedDecode) and graph.prefetch != self.model.moe.prefetch)):
                self._graph = None  # its memory goes back before the next one is captured
                try:
                    self._graph = kind(self.model, cache, self.device)
                    if isinstance(self._graph, DecodeGraph):
                        self._captured_over(cache)
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as exc:  # an operation CUDA cannot capture: the same step, eagerly
                    log.warning("decode step not captured as a CUDA graph (%s); running it eagerly", exc)
                    self.graphs = False
            if self._graph is not None:
                logits = self._graph.step(token)
                if isinstance(self._graph, SegmentedDecode):
                    if self._graph.failed is not None:
                        log.warning("decode step not captured as CUDA graphs (%s); running it eagerly",
                                    self._graph.failed)
                        self._graph = None
                        self.graphs = False
                    elif self._graph.graphs and self._buffers is None:  # captured in this step
                        self._captured_over(cache)
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

    def generate(self, prompt: list[int], n: int, sampler: Sampler, cache: KVCache | None = None,
                 stop: set[int] = frozenset()) -> tuple[list[int], torch.Tensor]:
        """Prompt logits [len(prompt), V] and up to n new tokens (stopping after a `stop` token)."""
        cache = cache or self.new_cache()
        logits = self.forward(prompt, cache)
        prompt_logits = logits
        out: list[int] = []
        for _ in range(n):
            token = sampler(logits[-1])
            out.append(token)
            if token in stop or len(out) == n:
                break
            logits = self.forward([token], cache)
        return out, prompt_logits


def _device_cache(manifest: Manifest, link: DaemonLink, device: torch.device, cache_bytes: int, reserve_bytes: int,
                  layers: list[int], pending: deque, n_devices: int) -> ExpertCache:
    """One device's expert cache of a split worker; a refusal names the device and its layers."""
    try:
        return ExpertCache(manifest, link, device, cache_bytes, reserve_bytes, layers, pending)
    except CacheTooSmall as exc:
        shared = f"; the {n_devices} CPU devices share the budget evenly" if device.type == "cpu" else ""
        raise CacheTooSmall(f"{device} (MoE layers {layers[0]}..{layers[-1]}): {exc}{shared}") from None


def _require_triton(device: torch.device) -> None:
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"device {device}: the GPU path runs Triton kernels, and triton is not installed "
                           f"(it comes with torch's CUDA builds; pip install triton)")


class DecodeGraph:
    """One model's decode step (or a prompt of `tokens` tokens, logits of its last with `last`)
    captured as a CUDA graph over one KV cache (its buffers reserved ahead: `capacity` positions),
    replayed per step: the tokens and their positions are written into static device buffers and
    the step runs as one launch instead of hundreds from Python. Captured after a warm-up on a side
    stream (kernels compile, vectors are made), as torch.cuda.graph asks; into `pool` where given
    (graphs that never run at once can share one)."""

    def __init__(self, model: Model, cache: KVCache, device: torch.device, tokens: int = 1, last: bool = False,
                 pool: object = None) -> None:
        self.model, self.cache = model, cache
        self.capacity = cache.capacity
        self.token = torch.zeros(tokens, dtype=torch.int64, device=device)
        self._offsets = torch.arange(tokens, dtype=torch.int64, device=device)
        self.position = self._offsets + cache.length
        length = cache.length
        states = [t.clone() for t in cache.state_tensors()]  # the warm-up steps advance them: put back after
        cache.step_positions = self.position
        try:
            if not cache.keys:  # a prompt into an empty cache: its buffers made on the stream that uses them
                model.forward(self.token, cache, last)
                cache.length = length
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # writes the next positions' keys, which the first replay overwrites
                    model.forward(self.token, cache, last)
                    cache.length = length
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.logits = model.forward(self.token, cache, last).to(torch.float32)
        finally:
            cache.step_positions = None
            cache.length = length
            for live, saved in zip(cache.state_tensors(), states):
                live.copy_(saved)

    def step(self, tokens: int | list[int]) -> torch.Tensor:
        """Logits after a token (a decode step's) or after the prompt's `tokens`."""
        if isinstance(tokens, int):
            self.token.fill_(tokens)
            self.position.fill_(self.cache.length)
        else:
            self.token.copy_(torch.tensor(tokens, dtype=torch.int64))
            torch.add(self._offsets, self.cache.length, out=self.position)
        self.graph.replay()
        self.cache.length += self.token.shape[0]
        return self.logits.clone()


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
    buffers and host steps."""

    def __init__(self, model: Model, cache: KVCache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.capacity = cache.capacity
        self.prefetch = model.moe.prefetch  # captured with or without the guesses' router
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.stops: list[_Stop] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []  # len(stops) + 1 once captured
        self.logits: torch.Tensor | None = None  # the last graph's output
        self.failed: RuntimeError | None = None
        self.pool = None  # the memory pool the graphs share
        self._at = 0  # the stop the pass reaches next
        self._capturing = False
        self._open: torch.cuda.CUDAGraph | None = None  # the graph being captured

    @staticmethod
    def fits(model: Model) -> bool:
        """A step's experts fit the cache in one wave (one token's k). (DeepSeek-V4's hash layers,
        whose experts follow from the token, are looked up in the graph from its token buffer.)"""
        source = model.moe.source
        return isinstance(source, ExpertCache) and source.capacity >= source.manifest.model.n_expert_used

    def step(self, token: int) -> torch.Tensor:
        self.token.fill_(token)
        self.position.fill_(self.cache.length)
        if not self.graphs:
            logits = self._pass()
            if self.device.type == "cuda" and self.failed is None:
                self._capture()
            return logits
        for graph, stop in zip(self.graphs, self.stops):
            graph.replay()
            self._between(stop)
        self.graphs[-1].replay()
        self.cache.length += 1
        return self.logits.clone()

    def _pass(self, capture: bool = False) -> torch.Tensor:
        """One forward pass through the stops: eagerly (each stop's host step runs there), or
        captured (each stop ends a graph and begins the next)."""
        moe = self.model.moe
        self._at, self._capturing = 0, capture
        self.cache.step_positions, moe.boundary = self.position, self._boundary
        try:
            logits = self.model.forward(self.token, self.cache).to(torch.float32)
        finally:
            self.cache.step_positions, moe.boundary = None, None
            self._capturing = False
        if self._at != len(self.stops):
            raise RuntimeError(f"the pass stopped at {self._at} MoE layers, the step has {len(self.stops)}")
        return logits

    def _boundary(self, layer: int, ids: torch.Tensor, guesses: Guesses) -> ExpertRows:
        """ExpertFFN's stop at `layer`: the routing (and the lookahead's guesses) into the stop's
        buffer, then the host step (eager) or the end of one graph and the start of the next (capture)."""
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
        only the cache's length, which the model's forward advances, is put back."""
        length = self.cache.length
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does: cached blocks back, for the pool to take
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
            self.cache.length = length
            current.wait_stream(side)
