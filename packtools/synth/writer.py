"""`expertpack synth`: writes a synthetic GGUF (or a llama.cpp split set) of a preset's architecture
and shapes, random valid weights, and a small tokenizer. Streams tensor by tensor in bounded memory,
into `.partial` files renamed at the end, so an interrupted run never leaves a plausible model.
What each shard holds (plan_shards) and each tensor's bytes in order (tensor_chunks) are shared with
stream.py, which hands the same bytes to a build instead of a file (`synth --pack`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType
from tqdm import tqdm

from ..errors import DiskSpaceError, ExpertpackError, OutputExistsError
from ..gguf_source import MetadataField
from ..gguf_stream import TensorInfo, write_header
from ..quants import QUANTS, nbytes_of
from ..units import GIB, human_bytes
from .archs import ARCHS, Kind, Meta, TensorSpec
from .presets import PRESETS
from .quant_fill import SCALES, RandomFill, parse_type
from .skew import expert_gains, skewed_expert_ids
from .vocab import tokenizer_fields

log = logging.getLogger("expertpack.synth")

CHUNK_BYTES = 16 << 20
# Gains on the random weights that keep tokens apart through the layers. A random model's attention
# averages its values over the context, so at full scale it washes every token into one hidden state
# and every router sends all tokens to the same few experts (useless for measuring a cache). A
# strong embedding and a weak attention output keep routing as diverse as the tokens are.
GAINS = {"token_embd.weight": 32.0, "attn_output.weight": 1 / 128}  # tensor name suffix -> gain


@dataclass(frozen=True)
class SynthOptions:
    preset: str
    n_layer: int | None = None
    n_expert: int | None = None  # a cut of each MoE layer's experts (each keeps its shape); None: the preset's
    expert_type: str | None = None
    trunk_type: str | None = None
    expert_mix: str | None = None  # per-role / per-layer expert types over expert_type (parse_mix)
    shards: int = 1
    seed: int = 0
    force: bool = False
    progress: bool = True
    routing_skew: float = 0.0  # Zipf-like expert popularity per layer (skew.py); 0: uniform routing


# The routed expert tensors a --mix role names, by the role name the pack uses.
MIX_ROLES = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}


@dataclass(frozen=True)
class ExpertMix:
    """Expert types that depart from the base type, as llama.cpp's low-bit "dynamic" quants mix
    them: ffn_down_exps a step above gate/up (its errors are not averaged over a SwiGLU), some
    layers (often the first) at more bits. A layer's type wins over a role's for that layer."""

    roles: tuple[tuple[str, T], ...] = ()  # (tensor name without blk.N., type)
    layers: tuple[tuple[range, T], ...] = ()

    def type_of(self, name: str, base: T) -> T:
        """The type of expert tensor `name` (blk.N.…) whose type is otherwise `base`."""
        layer, role_name = _layer(name), name.split(".", 2)[2]
        for layers, t in self.layers:
            if layer in layers:
                return t
        return next((t for r, t in self.roles if r == role_name), base)


def parse_mix(spec: str) -> ExpertMix:
    """`down=IQ2_XXS,0-1=Q4_K`: comma-separated ROLE=TYPE (gate, up, down) and LAYERS=TYPE (a layer
    N or a range N-M, inclusive) entries; ValueError names the entry it cannot read."""
    roles: list[tuple[str, T]] = []
    layers: list[tuple[range, T]] = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        key, sep, type_name = entry.partition("=")
        if not sep:
            raise ValueError(f"--mix entry {entry!r} is not KEY=TYPE (e.g. down=IQ2_XXS or 0-1=Q4_K)")
        t = parse_type(type_name.strip())
        key = key.strip()
        if key in MIX_ROLES:
            roles.append((MIX_ROLES[key], t))
            continue
        first, _, last = key.partition("-")
        if not (first.isdigit() and (last or first).isdigit()) or int(last or first) < int(first):
            raise ValueError(f"--mix entry {entry!r}: {key!r} is neither a role ({', '.join(MIX_ROLES)}) "
                             f"nor a layer or range of layers (3, 0-2)")
        layers.append((range(int(first), int(last or first) + 1), t))
    return ExpertMix(tuple(roles), tuple(layers))


@dataclass(frozen=True, slots=True)
class SynthTensor:
    spec: TensorSpec
    ggml_type: T
    nbytes: int

    def info(self) -> TensorInfo:
        return TensorInfo(self.spec.name, self.spec.shape, self.ggml_type, self.nbytes)


@dataclass(frozen=True)
class SynthPlan:
    arch: str
    n_vocab: int
    n_expert: int
    metadata: list[MetadataField]
    tensors: list[SynthTensor]
    seed: int = 0
    routing_skew: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_synth(options: SynthOptions) -> SynthPlan:
    preset = PRESETS[options.preset]
    if not (0.0 <= options.routing_skew < float("inf")):
        raise ExpertpackError(f"--routing-skew must be 0 or more, got {options.routing_skew!r}")
    try:
        expert_type = parse_type(options.expert_type or preset.expert_type)
        trunk_type = parse_type(options.trunk_type or preset.trunk_type)
        by_name = {name: parse_type(t) for name, t in preset.types.items()}
        fallback = parse_type(preset.fallback_type)
        mix = parse_mix(options.expert_mix or "")
    except ValueError as exc:
        raise ExpertpackError(str(exc)) from None
    values = _truncated(preset.meta, options.n_layer)
    if options.n_expert is not None:
        used, groups = values["expert_used_count"], values.get("expert_group_count", 1)
        if options.n_expert < used or options.n_expert % groups:
            raise ExpertpackError(f"n_expert {options.n_expert}: {options.preset} needs at least {used} (the experts "
                                  f"a token uses) and a multiple of {groups} (its expert groups)")
        values["expert_count"] = options.n_expert
    arch_meta = {f"{preset.arch}.{k}": v for k, v in values.items()}
    specs = ARCHS[preset.arch](Meta(preset.arch, arch_meta, preset.n_vocab))
    if not any(spec.kind is Kind.EXPERT for spec in specs):
        dense = values.get("leading_dense_block_count", 0)
        raise ExpertpackError(f"--layers {options.n_layer} keeps only dense layers of {options.preset} (its first "
                              f"{dense} layers are dense); use --layers {dense + 1} or more")
    # --type / --trunk-type replace the preset's whole mix for their kind of tensor
    kept = {Kind.EXPERT: options.expert_type is None, Kind.MATRIX: options.trunk_type is None}
    tensors = [_typed(spec, _named_type(spec, by_name, kept), expert_type, trunk_type, fallback) for spec in specs]
    tensors = [_mixed(t, mix) for t in tensors]
    metadata = [
        MetadataField("general.type", "model", GGUFValueType.STRING),
        MetadataField("general.name", f"expertpack synth {options.preset}", GGUFValueType.STRING),
        *(_field(k, v) for k, v in arch_meta.items()),
        MetadataField("general.quantization_version", 2, GGUFValueType.UINT32),
        *tokenizer_fields(preset.family, preset.pre, preset.n_vocab),
        MetadataField("expertpack.synth.preset", options.preset, GGUFValueType.STRING),
        MetadataField("expertpack.synth.seed", options.seed, GGUFValueType.UINT32),
    ]
    if options.routing_skew:  # absent at 0: a uniform model's file is what it always was
        metadata.append(MetadataField("expertpack.synth.routing_skew", options.routing_skew, GGUFValueType.FLOAT32))
    return SynthPlan(preset.arch, preset.n_vocab, int(values["expert_count"]), metadata, tensors, options.seed,
                     options.routing_skew)


def describe_presets() -> str:
    """The table of `expertpack synth --list`: each preset's size from the same plan the writer uses."""
    lines = [f"{'preset':<20} {'arch':<10} {'experts':>9} {'size':>11}  description"]
    for name, p in PRESETS.items():
        plan = plan_synth(SynthOptions(preset=name))
        lines.append(f"{name:<20} {p.arch:<10} {p.expert_types():>9} {human_bytes(plan.total_bytes):>11}  {p.description}")
    return "\n".join(lines)


def shard_paths(out: Path, shards: int) -> list[Path]:
    if shards == 1:
        return [out]
    stem = out.name.removesuffix(".gguf")
    return [out.with_name(f"{stem}-{i:05d}-of-{shards:05d}.gguf") for i in range(1, shards + 1)]


@dataclass(frozen=True)
class SynthShard:
    """One file of the output: the header write_header gets for it and its tensors, in file order."""

    arch: str | None  # None: a split set's later shards carry no general.architecture
    metadata: list[MetadataField]
    tensors: list[SynthTensor]

    def infos(self) -> list[TensorInfo]:
        return [t.info() for t in self.tensors]


def plan_shards(plan: SynthPlan, shards: int) -> list[SynthShard]:
    """The `shards` files of the model, tensors in plan order, split into runs of about equal bytes."""
    if shards < 1 or shards > len(plan.tensors):
        raise ExpertpackError(f"--shards must be between 1 and the tensor count {len(plan.tensors)}")
    return [SynthShard(plan.arch if index == 0 else None,
                       _shard_metadata(plan.metadata, index, shards, len(plan.tensors)), group)
            for index, group in enumerate(_balanced_groups(plan.tensors, shards))]


def write_synth(out: Path, options: SynthOptions) -> list[Path]:
    plan = plan_synth(options)
    shards = plan_shards(plan, options.shards)
    paths = shard_paths(out, options.shards)
    existing = [str(p) for p in paths if p.exists()]
    if existing and not options.force:
        raise OutputExistsError(f"{', '.join(existing)} already exists; pass --force to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(out.parent)
    if st.f_bavail * st.f_frsize < plan.total_bytes + GIB // 4:
        raise DiskSpaceError(f"{out.parent} has {human_bytes(st.f_bavail * st.f_frsize)} free; "
                             f"the model needs {human_bytes(plan.total_bytes)}")
    log.info("synth %s (%s): %d tensors, %s, %d shard(s)", options.preset, plan.arch, len(plan.tensors),
             human_bytes(plan.total_bytes), options.shards)
    fill = RandomFill(options.seed)
    with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="synth",
              disable=not options.progress, mininterval=0.5, dynamic_ncols=True) as bar:
        for path, shard in zip(paths, shards):
            partial = path.with_name(path.name + ".partial")
            layout = write_header(partial, shard.arch, shard.metadata, shard.infos())
            fd = os.open(partial, os.O_RDWR)
            try:
                os.ftruncate(fd, layout.size_bytes)  # the gaps between tensors read as the zeros GGUFWriter pads with
                for t in shard.tensors:
                    at = layout.offsets[t.spec.name]
                    for data in tensor_chunks(t, plan, fill):
                        _pwrite(fd, data, at)
                        at += data.nbytes
                        bar.update(data.nbytes)
                os.fsync(fd)
            finally:
                os.close(fd)
    for path in paths:
        os.replace(path.with_name(path.name + ".partial"), path)
    return paths


def tensor_chunks(t: SynthTensor, plan: SynthPlan, fill: RandomFill) -> Iterator[np.ndarray]:
    """The bytes of tensor `t` (flat uint8 arrays of at most CHUNK_BYTES, a hash-routing table whole),
    in order. `fill` is one random sequence over the whole model: tensors must be asked for in plan
    order, each to its end, for the same seed to give the same bytes."""
    if t.spec.kind is Kind.INDEX:
        k, n_vocab = t.spec.shape
        data = fill.expert_ids(plan.n_expert, k, n_vocab).view(np.uint8)
        if plan.routing_skew:  # drawn anyway above, so that the weights after it stay the same
            data = skewed_expert_ids(plan.seed, _layer(t.spec.name), plan.n_expert, k, n_vocab,
                                     plan.routing_skew).view(np.uint8)
        yield np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        return
    block_bytes = QUANTS[t.ggml_type].nbytes
    per_chunk = max(1, CHUNK_BYTES // block_bytes) * block_bytes
    if t.ggml_type not in SCALES:  # float values come from a pool of normal_pool.size (F16: half a chunk)
        per_chunk = min(per_chunk, fill.normal_pool.size * block_bytes)
    done = 0
    while done < t.nbytes:
        n = min(per_chunk, t.nbytes - done)
        gain = next((g for suffix, g in GAINS.items() if t.spec.name.endswith(suffix)), 1.0)
        if t.ggml_type in SCALES:
            data = fill.quant(t.ggml_type, n, gain)
        elif t.spec.kind is Kind.NORM:
            data = fill.floats(t.ggml_type, n // block_bytes, mean=1.0, std=0.1)
        else:
            data = fill.floats(t.ggml_type, n // block_bytes, std=0.02 * gain)
            if t.spec.kind is Kind.ROUTER and plan.routing_skew:
                data = _skewed_router(data, done, t, plan)
        assert data.nbytes == n, (t.spec.name, data.nbytes, n)
        yield np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        done += n


def _skewed_router(data: np.ndarray, done: int, t: SynthTensor, plan: SynthPlan) -> np.ndarray:
    """Scales each expert's router row (ggml ne0 = the hidden size, one row per expert) by its gain."""
    assert t.ggml_type == T.F32, t  # routers are written as F32
    values = data.view(np.float32)
    first = done // 4
    rows = (first + np.arange(len(values))) // t.spec.shape[0]  # the expert of each value
    gains = expert_gains(plan.seed, _layer(t.spec.name), plan.n_expert, plan.routing_skew)
    return (values * gains[rows]).view(np.uint8)


def _layer(name: str) -> int:
    """blk.N.… -> N"""
    return int(name.split(".")[1])


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _named_type(spec: TensorSpec, by_name: dict[str, T], kept: dict[Kind, bool]) -> T | None:
    """The preset's type for this tensor by name (`blk.N.` stripped), unless an option replaced it."""
    name = spec.name.split(".", 2)[2] if spec.name.startswith("blk.") else spec.name
    return by_name.get(name) if kept.get(spec.kind, False) else None


def _typed(spec: TensorSpec, named: T | None, expert_type: T, trunk_type: T, fallback: T) -> SynthTensor:
    if spec.kind is Kind.EXPERT:
        t = named or expert_type
    elif spec.kind is Kind.MATRIX:
        t = named or trunk_type
        t = t if spec.shape[0] % QUANTS[t].values == 0 else fallback
    elif spec.kind is Kind.INDEX:
        t = T.I32
    else:
        t = T.F32
    block_values = QUANTS[t].values
    if spec.shape[0] % block_values:
        raise ExpertpackError(f"{spec.name}: rows of {spec.shape[0]} values do not fit {t.name} blocks of "
                              f"{block_values}; choose another --type")
    return SynthTensor(spec, t, nbytes_of(t, spec.shape))


def _mixed(t: SynthTensor, mix: ExpertMix) -> SynthTensor:
    """t with the --mix type of a routed expert tensor, re-checked against its rows."""
    if t.spec.kind is not Kind.EXPERT:
        return t
    new = mix.type_of(t.spec.name, t.ggml_type)
    return t if new == t.ggml_type else _typed(t.spec, new, new, new, new)


# Per-layer arrays that say which kind of layer each is (DeepSeek-V4's attention: 0 sliding window,
# 4 CSA, 128 HCA; Kimi-K3's head_count_kv: 0 KDA, 1 MLA). A cut keeps one layer of every kind where it has room: llama.cpp's graph for a
# DeepSeek-V4 without any compressed layer dies with SIGFPE (a 2-layer cut of [0, 0, 4, 128, ...]).
LAYER_KINDS = ("attention.compress_ratios", "attention.head_count_kv")


def _every_kind(kinds: list[Any], n_layer: int) -> list[Any]:
    """The first n_layer entries, with the kinds the cut would lose (in the order they first
    appear) put in place of repeated ones, last first, while the cut has room for them."""
    cut = list(kinds[:n_layer])
    missing = [k for k in dict.fromkeys(kinds) if k not in cut]
    for pos in reversed(range(n_layer)):
        if missing and cut.count(cut[pos]) > 1:
            cut[pos] = missing.pop(0)
    return cut


def _truncated(meta: dict[str, Any], n_layer: int | None) -> dict[str, Any]:
    """The preset's metadata for its first n_layer layers; per-layer arrays are cut to match
    (layer kinds keep one of each, see LAYER_KINDS)."""
    full = meta["block_count"]
    if n_layer is None or n_layer == full:
        return dict(meta)
    if not 1 <= n_layer <= full:
        raise ExpertpackError(f"--layers must be between 1 and {full}")
    out = {k: (v[:n_layer] if isinstance(v, list) and len(v) == full else v) for k, v in meta.items()}
    out["block_count"] = n_layer
    for key in LAYER_KINDS:
        if isinstance(out.get(key), list):  # a scalar head_count_kv is the same for every layer
            out[key] = _every_kind(meta[key], n_layer)
    for key in ("leading_dense_block_count", "hash_layer_count"):  # counts of leading layers
        if key in out:
            out[key] = min(out[key], n_layer)
    return out


def _field(key: str, value: Any) -> MetadataField:
    if isinstance(value, bool):
        return MetadataField(key, value, GGUFValueType.BOOL)
    if isinstance(value, int):
        return MetadataField(key, value, GGUFValueType.UINT32)
    if isinstance(value, float):
        return MetadataField(key, value, GGUFValueType.FLOAT32)
    if isinstance(value, str):
        return MetadataField(key, value, GGUFValueType.STRING)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return MetadataField(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return MetadataField(key, value, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    raise TypeError(f"preset metadata {key}: no GGUF type for {value!r}")


def _shard_metadata(metadata: list[MetadataField], index: int, shards: int, n_tensors: int) -> list[MetadataField]:
    """llama-gguf-split's convention: every shard has split.*, only the first has the model's keys."""
    if shards == 1:
        return metadata
    split = [MetadataField("split.no", index, GGUFValueType.UINT16),
             MetadataField("split.count", shards, GGUFValueType.UINT16),
             MetadataField("split.tensors.count", n_tensors, GGUFValueType.INT32)]
    return (metadata + split) if index == 0 else split


def _balanced_groups(tensors: list[SynthTensor], shards: int) -> list[list[SynthTensor]]:
    """Consecutive runs of tensors of about equal bytes, none empty."""
    cumulative = np.cumsum([t.nbytes for t in tensors])
    bounds = [0]
    for g in range(1, shards):
        end = int(np.searchsorted(cumulative, cumulative[-1] * g / shards)) + 1
        end = min(max(end, bounds[-1] + 1), len(tensors) - (shards - g))
        bounds.append(end)
    bounds.append(len(tensors))
    return [tensors[a:b] for a, b in zip(bounds, bounds[1:])]
