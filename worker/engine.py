"""Prefill and decode over one model and one KV cache: logits for a prompt, then one token at a
time, greedy or sampled. No HTTP, no daemon: the expert source decides where experts come from."""

from __future__ import annotations

import importlib.util
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertpack.packtools.layout import Manifest

from .cache_policy import CacheTooSmall
from .daemon_link import DaemonLink
from .expert_cache import ExpertCache
from .layers import KVCache
from .model_files import ModelFiles, PackExperts, ResidentExperts, expert_layers, open_model
from .models import Model, model_module
from .placement import Placement, parse_devices, plan
from .sampling import Sampler
from .split_experts import CacheGroup, SplitExperts
from .weights import use_kernels


log = logging.getLogger("expert-worker")

MIN_STATIC_CAPACITY = 512  # positions a GPU decode step's KV cache is reserved for, at least


@dataclass
class Engine:
    model: Model
    files: ModelFiles
    device: torch.device  # where the tokens go in: the first of place.devices
    place: Placement
    graphs: bool = True  # capture resident decode steps as CUDA graphs where the model allows it
    _graph: "DecodeGraph | None" = field(default=None, repr=False)

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
        self._graph = None
        self.files.experts.close()

    def new_cache(self) -> KVCache:
        return KVCache()

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: KVCache, last: bool = False) -> torch.Tensor:
        """Logits [len(tokens), n_vocab] (float32) after each token, continuing the cache; with
        `last`, [1, n_vocab] after the last token only (what a generation's prefill needs)."""
        with self.place.running():
            if len(tokens) == 1 and cache.length and use_kernels(self.device) and self.model.static_decode:
                return self._static_step(tokens[0], cache)
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            return self.model.forward(ids, cache, last).to(torch.float32)

    def _static_step(self, token: int, cache: KVCache) -> torch.Tensor:
        """A decode step on the GPU with the same shapes at every position: the KV cache reserved
        ahead and attended whole, masked by position. With every expert resident the step is a
        CUDA graph, replayed; with the expert cache (a host sync per layer for its misses, which a
        graph cannot hold) the same operations run eagerly, so both give the same bits. Over several
        devices the step runs eagerly too (one graph per device range is not written yet)."""
        capacity = cache.capacity
        if capacity <= cache.length or capacity < MIN_STATIC_CAPACITY or capacity & (capacity - 1):
            cache.reserve(max(MIN_STATIC_CAPACITY, 1 << cache.length.bit_length()))  # a power of two > length
        if (self.graphs and self.device.type == "cuda" and not self.place.split
                and isinstance(self.files.experts, ResidentExperts)
                and self.model.moe.routing_log is None):
            if (self._graph is not None and self._graph.cache is not cache
                    and self._graph.capacity == cache.capacity and cache.same_shapes(self._graph.cache)):
                cache.trade_buffers(self._graph.cache)  # the next request: no new capture
                self._graph.cache = cache
            if self._graph is None or self._graph.cache is not cache or self._graph.capacity != cache.capacity:
                self._graph = None  # its memory goes back before the next one is captured
                try:
                    self._graph = DecodeGraph(self.model, cache, self.device)
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as exc:  # an operation CUDA cannot capture: the same step, eagerly
                    log.warning("decode step not captured as a CUDA graph (%s); running it eagerly", exc)
                    self.graphs = False
            if self._graph is not None:
                return self._graph.step(token)
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
    """One model's decode step captured as a CUDA graph over one KV cache (its buffers reserved
    ahead: `capacity` positions), replayed per token: the token and its position are written into
    static device buffers and the step runs as one launch instead of hundreds from Python. Captured
    after a warm-up on a side stream (kernels compile, vectors are made), as torch.cuda.graph asks."""

    def __init__(self, model: Model, cache: KVCache, device: torch.device) -> None:
        self.model, self.cache = model, cache
        self.capacity = cache.capacity
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = torch.full((1,), cache.length, dtype=torch.int64, device=device)
        length = cache.length
        states = [t.clone() for t in cache.state_tensors()]  # the warm-up steps advance them: put back after
        cache.step_positions = self.position
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # writes the next position's keys, which the first replay overwrites
                    model.forward(self.token, cache)
                    cache.length = length
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = model.forward(self.token, cache).to(torch.float32)
        finally:
            cache.step_positions = None
            cache.length = length
            for live, saved in zip(cache.state_tensors(), states):
                live.copy_(saved)

    def step(self, token: int) -> torch.Tensor:
        self.token.fill_(token)
        self.position.fill_(self.cache.length)
        self.graph.replay()
        self.cache.length += 1
        return self.logits.clone()
