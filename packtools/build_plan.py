"""What a build will write, computed from the source's header alone: the expert block layout, the
trunk's tensors and metadata, and a plan id that changes whenever any of it (or the source files)
changes, so that a resumed build never mixes two plans. `expertpack inspect SRC.gguf` uses the same
plan to report sizes without building."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ClassifyError
from .experts import Classification, classify
from .gguf_source import GGUFSource, MetadataField, open_source
from .gguf_stream import ARCH_KEY, TensorInfo
from .layout import FORMAT_VERSION, TRUNK_FINGERPRINT_KEY, LayerLayout, RoleSpec, plan_layers

PLAN_SCHEMA = 1  # bump when the builder's output changes for the same input


@dataclass(frozen=True)
class BuildPlan:
    source: GGUFSource
    classification: Classification
    layers: tuple[LayerLayout, ...]  # without hashes
    pack_size_bytes: int
    trunk_tensors: tuple[TensorInfo, ...]  # source order, which is the order the copy meets them
    trunk_metadata: tuple[MetadataField, ...]  # source keys to copy (general.architecture is implied)
    dropped_keys: tuple[str, ...]  # keys gguf-py cannot write (empty arrays), reported to the user

    @property
    def trunk_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.trunk_tensors)

    def plan_id(self) -> str:
        described = {
            "schema": PLAN_SCHEMA,
            "format_version": FORMAT_VERSION,
            "source": self.source.identity(),
            "layers": [[l.layer, l.offset, l.stride, l.payload_bytes,
                        [[r.role, r.tensor, r.offset, r.nbytes] for r in l.roles]] for l in self.layers],
            "trunk": [[t.name, t.nbytes] for t in self.trunk_tensors],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def plan_build(src: Path | str | GGUFSource) -> BuildPlan:
    """The plan for a GGUF file (or split set), or for a source already described (synth's, whose
    bytes are made as the build reads them)."""
    source = src if isinstance(src, GGUFSource) else open_source(src)
    if TRUNK_FINGERPRINT_KEY in source.metadata:
        raise ClassifyError(f"{source.shards[0].path}: this is the trunk.gguf of an expert pack, not a model "
                            "source; build from the original GGUF")
    cls = classify(source)
    n_expert = cls.n_expert
    roles: dict[int, list[RoleSpec]] = {}
    for e in cls.experts:
        roles.setdefault(e.layer, []).append(
            RoleSpec(e.role, e.source.name, e.source.type_name, e.expert_shape, e.bytes_per_expert)
        )
    layers, pack_size = plan_layers(roles, n_expert)

    metadata: list[MetadataField] = []
    dropped: list[str] = []
    for field in source.metadata.values():
        if field.key == ARCH_KEY:
            continue
        if isinstance(field.value, list) and not field.value:
            dropped.append(field.key)
            continue
        metadata.append(field)
    trunk = tuple(TensorInfo(t.name, t.shape, t.ggml_type, t.nbytes) for t in cls.trunk)
    return BuildPlan(source, cls, layers, pack_size, trunk, tuple(metadata), tuple(dropped))
