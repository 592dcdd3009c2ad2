"""An ExpertSource for a worker whose layers span several devices (placement.py): one source per
device holding its own layers' experts (a resident table, or an expert cache fed by the one
expertd connection all of them share), chosen by layer. `CacheGroup` is the same over expert
caches, and answers for all of them what a single ExpertCache answers (counters, stats, the
daemon link) to the generation loop, /metrics and /health."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from expertpack.packtools.layout import LayerLayout

from .source import ExpertRows, ExpertSource, ExpertWeights
from .expert_cache import CacheCounters, ExpertCache, prefetch_rates


class SplitExperts:
    def __init__(self, parts: Sequence[tuple[Sequence[int], ExpertSource]]) -> None:
        """`parts`: (the MoE layers, their source) per device; every layer in exactly one."""
        self.parts = [source for _, source in parts]
        self.source_of: dict[int, ExpertSource] = {}
        for layers, source in parts:
            for layer in layers:
                if layer in self.source_of:
                    raise ValueError(f"layer {layer} is given to two expert sources")
                self.source_of[layer] = source

    @property
    def capacity(self) -> int | None:
        """The most experts one load() may ask of any part (ExpertFFN's waves on the torch path)."""
        capacities = [c for c in (getattr(s, "capacity", None) for s in self.parts) if c]
        return min(capacities) if capacities else None

    def layout(self, layer: int) -> LayerLayout:
        return self.source_of[layer].layout(layer)

    def load(self, layer: int, experts: Sequence[int], then: Callable[[], None] | None = None
             ) -> dict[int, ExpertWeights]:
        source = self.source_of[layer]
        return source.load(layer, experts) if then is None else source.load(layer, experts, then)

    def expert_rows(self, layer: int, ids: torch.Tensor, then: Callable[[], None] | None = None
                    ) -> Iterator[ExpertRows]:
        """`then`: a prefetching part's (ExpertCache.waves), given only to parts that prefetch."""
        source = self.source_of[layer]
        return source.expert_rows(layer, ids) if then is None else source.expert_rows(layer, ids, then)

    def close(self) -> None:
        for source in self.parts:
            source.close()


class SummedCounters:
    """The caches' counters added up, read like one cache's CacheCounters."""

    def __init__(self, parts: Sequence[CacheCounters]) -> None:
        self.parts = parts

    def snapshot(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for part in self.parts:
            for key, value in part.snapshot().items():
                total[key] = total.get(key, 0) + value
        return total

    def since(self, before: dict[str, float]) -> dict[str, float]:
        return {k: v - before[k] for k, v in self.snapshot().items()}


class CacheGroup(SplitExperts):
    """Expert caches, one per device, sharing one DaemonLink (its staging leases too: a staging slot
    whose copy one cache issued is released by whichever cache polls next, ExpertCache.pending)."""

    def __init__(self, parts: Sequence[tuple[Sequence[int], ExpertCache]]) -> None:
        super().__init__(parts)
        self.caches: list[ExpertCache] = [cache for _, cache in parts]
        self.link = self.caches[0].link
        self.manifest = self.caches[0].manifest
        self.slot_bytes = self.caches[0].slot_bytes
        self.counters = SummedCounters([c.counters for c in self.caches])

    @property
    def n_slots(self) -> int:
        return sum(c.n_slots for c in self.caches)

    def fill(self) -> int:
        """ExpertCache.fill on every device (each keeps its share of the session's keep budget)."""
        return sum(cache.fill() for cache in self.caches)

    def ahead(self, layer: int, depth: int) -> tuple[int, ...]:
        """Prefetch stays on the device of `layer`: its cache's next layers (ExpertCache.ahead)."""
        return self.source_of[layer].ahead(layer, depth)

    def prefetch(self, layer: int, experts: Sequence[int], running: int | None = None) -> None:
        self.source_of[layer].prefetch(layer, experts, running)

    def layer_done(self, layer: int) -> None:
        self.source_of[layer].layer_done(layer)

    @property
    def resident_bytes(self) -> int:
        return sum(c.resident_bytes for c in self.caches)

    def stats(self) -> dict:
        """ExpertCache.stats() over every device: the counters added up, and each device's own."""
        counters = self.counters.snapshot()
        return {"cache": {**counters, **prefetch_rates(counters), "slots": self.n_slots, "slot_bytes": self.slot_bytes,
                          "resident_bytes": self.resident_bytes, "staging_pinned": self.link.pinned,
                          "reconnects": self.link.reconnects, "refetched": self.link.refetched},
                "devices": [{"device": str(c.device), **c.counters.snapshot(), "slots": c.n_slots} for c in self.caches],
                "daemon": (self.link.stats() or {}).get("counters")}

    def close(self) -> None:
        """Every device's copies finish before any staging slot goes back (the caches share them)."""
        for cache in self.caches:
            if cache.device.type == "cuda":
                torch.cuda.synchronize(cache.device)
        super().close()
