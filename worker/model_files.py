"""What the worker loads a model from: a pack directory (trunk.gguf + experts.pack) or a source GGUF
(one file or a split set). Either way it yields the metadata, the trunk tensors (everything but the
routed experts) and an expert source. The two expert sources here read straight from disk in this
process (the single-process mode); the daemon-fed cache is another source with the same interface."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from expertpack.packtools.experts import classify
from expertpack.packtools.gguf_source import GGUFSource, SourceTensor, open_source
from expertpack.packtools.errors import ManifestError
from expertpack.packtools.layout import PACK_FILE, TRUNK_FILE, TRUNK_FINGERPRINT_KEY, ExpertKey, Manifest

from .quant import check_supported
from .weights import QTensor

ExpertWeights = dict[str, QTensor]  # role ("gate", "up", "down", "gate_up", "down.bias", ...) -> tensor


class ExpertSource(Protocol):
    """Gives the weights of the experts a layer selected: all of them, every time."""

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]: ...


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

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        entry = self.manifest.layer(layer)
        out: dict[int, ExpertWeights] = {}
        for e in experts:
            block = os.pread(self.fd, entry.payload_bytes, entry.block_offset(e))
            if len(block) != entry.payload_bytes:
                raise OSError(f"experts.pack: short read of {ExpertKey(layer, e)}")
            data = torch.frombuffer(bytearray(block), dtype=torch.uint8)
            out[e] = {r.role: QTensor(r.tensor, GGMLQuantizationType[r.ggml_type], tuple(r.shape),
                                      data[r.offset:r.offset + r.nbytes])
                      for r in entry.roles}
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
    """Every expert loaded once onto `device` (the fully-resident compute floor that streaming is
    measured against, and the mode for models that fit)."""

    def __init__(self, source: ExpertSource, layers: dict[int, int], device: torch.device) -> None:
        self.weights: dict[int, dict[int, ExpertWeights]] = {}
        for layer, n_expert in layers.items():
            loaded = source.load(layer, range(n_expert))
            self.weights[layer] = {e: {r: t.to(device) for r, t in w.items()} for e, w in loaded.items()}

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        return {e: self.weights[layer][e] for e in experts}


def expert_layers(files: "ModelFiles") -> dict[int, int]:
    """MoE layer -> expert count, from the metadata and whatever the expert source serves."""
    n_expert = int(files.metadata[f"{files.arch}.expert_count"])
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
