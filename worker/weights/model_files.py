"""What the worker loads a model from: a pack directory (trunk.gguf + experts.pack) or a source GGUF
(one file or a split set). Either way it yields the metadata, the trunk tensors (everything but the
routed experts) and an expert source. The two expert sources here read straight from disk in this
process (the single-process mode); the daemon-fed cache is another source with the same interface."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from expertpack.packtools.errors import ManifestError
from expertpack.packtools.experts import classify
from expertpack.packtools.gguf_source import GGUFSource, SourceTensor, open_source
from expertpack.packtools.layout import (PACK_FILE, TRUNK_FILE, TRUNK_FINGERPRINT_KEY, ExpertKey, LayerLayout, Manifest,
                                         RoleSpec, manifest_problems, plan_layers)

from ..experts.source import ExpertRows, ExpertSource, ExpertWeights
from .qtensor import QTensor
from .quant import check_supported

@dataclass
class ModelFiles:
    arch: str
    metadata: dict[str, Any]
    trunk: dict[str, QTensor]
    experts: ExpertSource
    fingerprint: str | None  # the pack's, as trunk.gguf carries it, when loaded from a pack


def open_model(path: Path | str) -> ModelFiles:
    """A pack directory or a GGUF (first shard of a split set)."""
    path = Path(path)
    if path.is_dir():
        manifest = Manifest.load(path)
        problems = manifest_problems(manifest)
        if problems:
            raise ManifestError(f"{path}: the pack breaks the layout contract: {'; '.join(problems)}")
        source = open_source(path / TRUNK_FILE)
        trunk = {t.name: _read(source, t) for t in source.tensors}
        metadata = _values(source)
        fingerprint = metadata.get(TRUNK_FINGERPRINT_KEY)
        if fingerprint != manifest.fingerprint:
            raise ManifestError(f"{path}: trunk.gguf carries fingerprint {fingerprint!r} but the manifest says "
                                f"{manifest.fingerprint}; the files come from different builds; rebuild the pack")
        return ModelFiles(source.arch, metadata, trunk, PackExperts(path, manifest), fingerprint)
    source = open_source(path)
    cls = classify(source)
    trunk = {t.name: _read(source, t) for t in cls.trunk}
    return ModelFiles(source.arch, _values(source), trunk, GGUFExperts(source), None)


class PackExperts:
    """Experts read from experts.pack: one pread per expert block, roles sliced by the manifest."""

    def __init__(self, pack_dir: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        for entry in manifest.layers:  # an unsupported type fails now, not at the first token
            for r in entry.roles:
                check_supported(GGMLQuantizationType[r.ggml_type], r.tensor)
        self.fd = os.open(pack_dir / PACK_FILE, os.O_RDONLY)

    def layout(self, layer: int) -> LayerLayout:
        return self.manifest.layer(layer)

    def expert_rows(self, layer: int, ids: torch.Tensor) -> Iterator[ExpertRows]:
        return rows_from_blocks(self, layer, ids)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        entry = self.manifest.layer(layer)
        out: dict[int, ExpertWeights] = {}
        for e in experts:
            block = os.pread(self.fd, entry.payload_bytes, entry.block_offset(e))
            if len(block) != entry.payload_bytes:
                raise OSError(f"experts.pack: short read of {ExpertKey(layer, e)}")
            out[e] = block_views(entry, torch.frombuffer(bytearray(block), dtype=torch.uint8), 0)
        return out


class GGUFExperts:
    """Experts read from the source GGUF's stacked tensors: expert e is one contiguous byte range."""

    def __init__(self, source: GGUFSource) -> None:
        cls = classify(source)
        self.source = source
        self.roles: dict[int, list[tuple[str, SourceTensor, int]]] = {}
        for e in cls.experts:
            check_supported(e.source.ggml_type, e.source.name)
            self.roles.setdefault(e.layer, []).append((e.role, e.source, e.bytes_per_expert))
        self.fds = [os.open(s.path, os.O_RDONLY) for s in source.shards]
        specs = {layer: [RoleSpec(role, t.name, t.ggml_type.name, t.shape[:-1], per_expert) for role, t, per_expert in roles]
                 for layer, roles in self.roles.items()}
        self.layouts = {l.layer: l for l in plan_layers(specs, cls.n_expert)[0]}

    def layout(self, layer: int) -> LayerLayout:
        return self.layouts[layer]

    def expert_rows(self, layer: int, ids: torch.Tensor) -> Iterator[ExpertRows]:
        return rows_from_blocks(self, layer, ids)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        out: dict[int, ExpertWeights] = {}
        for e in experts:
            weights: ExpertWeights = {}
            for role, t, per_expert in self.roles[layer]:
                raw = os.pread(self.fds[t.shard], per_expert, t.offset + e * per_expert)
                weights[role] = QTensor(t.name, t.ggml_type, t.shape[:-1],
                                        torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            out[e] = weights
        return out


class ResidentExperts:
    """Every expert loaded once onto `device`, each layer one table of blocks laid out as the
    source's layout says (the fully-resident compute floor that streaming is measured against, and
    the mode for models that fit). The kernels' offset map is ids * stride: no host sync."""

    def __init__(self, source: ExpertSource, layers: dict[int, int], device: torch.device) -> None:
        self.layouts = {layer: source.layout(layer) for layer in layers}
        self.tables: dict[int, torch.Tensor] = {}
        for layer, n_expert in layers.items():
            layout = self.layouts[layer]
            self.tables[layer] = pack_blocks(layout, source.load(layer, range(n_expert))).to(device)

    def layout(self, layer: int) -> LayerLayout:
        return self.layouts[layer]

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        return {e: block_views(self.layouts[layer], self.tables[layer], e * self.layouts[layer].stride)
                for e in experts}

    def expert_rows(self, layer: int, ids: torch.Tensor) -> Iterator[ExpertRows]:
        yield ExpertRows(self.tables[layer], ids.reshape(-1).to(torch.int64) * self.layouts[layer].stride)

    def close(self) -> None:
        self.tables.clear()


def block_views(layout: LayerLayout, memory: torch.Tensor, base: int) -> ExpertWeights:
    """The roles of the block at byte `base` of `memory`, as QTensors viewing it (no copy)."""
    return {r.role: QTensor(r.tensor, GGMLQuantizationType[r.ggml_type], tuple(r.shape),
                            memory[base + r.offset: base + r.offset + r.nbytes])
            for r in layout.roles}


def pack_blocks(layout: LayerLayout, experts: dict[int, ExpertWeights]) -> torch.Tensor:
    """The experts' role tensors laid out in blocks as `layout` says, in the order of their ids:
    one uint8 host tensor of len(experts) * stride bytes."""
    where = {r.role: r.offset for r in layout.roles}
    out = torch.zeros(len(experts) * layout.stride, dtype=torch.uint8)
    for i, e in enumerate(sorted(experts)):
        for role, t in experts[e].items():
            start = i * layout.stride + where[role]
            out[start: start + t.raw.numel()] = t.raw
    return out


def rows_from_blocks(source: ExpertSource, layer: int, ids: torch.Tensor) -> Iterator[ExpertRows]:
    """ExpertRows from a source that reads role tensors per step (a pack or a GGUF on disk): the
    step's experts are laid out in blocks on the host and uploaded at once."""
    layout = source.layout(layer)
    order = sorted(set(ids.reshape(-1).tolist()))
    host = pack_blocks(layout, source.load(layer, order))
    table = torch.zeros(order[-1] + 1, dtype=torch.int64)
    table[torch.tensor(order)] = torch.arange(len(order)) * layout.stride
    yield ExpertRows(host.to(ids.device), table.to(ids.device)[ids.reshape(-1)])


def expert_count(files: "ModelFiles") -> int:
    """Routed experts per MoE layer, from the metadata."""
    return int(files.metadata[f"{files.arch}.expert_count"])


def expert_layers(files: "ModelFiles") -> dict[int, int]:
    """MoE layer -> expert count, from the metadata and whatever the expert source serves."""
    n_expert = expert_count(files)
    if isinstance(files.experts, PackExperts):
        return {l: n_expert for l in files.experts.manifest.model.moe_layers}
    if isinstance(files.experts, GGUFExperts):
        return {l: n_expert for l in files.experts.roles}
    raise TypeError(f"cannot list the layers of {type(files.experts).__name__}")


def _read(source: GGUFSource, t: SourceTensor) -> QTensor:
    raw = np.fromfile(source.shards[t.shard].path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    return QTensor(t.name, t.ggml_type, t.shape, torch.from_numpy(raw))


def _values(source: GGUFSource) -> dict[str, Any]:
    return {k: f.value for k, f in source.metadata.items()}
