"""Splits a model's tensors into routed experts and trunk by llama.cpp's stacked-expert naming
convention, not by a per-architecture list: every `blk.N.<stem>_exps.<suffix>` tensor whose outermost
ggml dimension is the model's expert count holds one slice per routed expert (gate, up, down, fused
gate_up, their biases and scales, for qwen2/3moe, mixtral, deepseek2/4, gpt-oss, kimi-k3, olmoe, ...).
Shared experts (`_shexp`), routers (`ffn_gate_inp`), selection biases (`exp_probs_b`), hash-routing
tables and dense layers match nothing here and stay in the trunk. Anything ambiguous is an error."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ClassifyError, DenseModelError
from .gguf_source import GGUFSource, SourceTensor
from .quants import block_sizes

EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<stem>[A-Za-z0-9_.]+?)_exps\.(?P<suffix>[A-Za-z0-9_]+)$")
# Pre-2024 llama.cpp wrote one tensor per expert; no current loader reads that layout.
LEGACY_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)\.\d+\.weight$")


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """A stacked per-expert tensor: expert e is bytes [e*bytes_per_expert, (e+1)*bytes_per_expert)."""

    layer: int
    role: str
    source: SourceTensor
    bytes_per_expert: int

    @property
    def expert_shape(self) -> tuple[int, ...]:
        """ggml ne of one expert's slice: the tensor's ne without its last (expert) dimension."""
        return self.source.shape[:-1]


@dataclass(frozen=True)
class Classification:
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    experts: tuple[ExpertTensor, ...]  # by layer, then in source order
    trunk: tuple[SourceTensor, ...]  # source order

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted({e.layer for e in self.experts}))


def role_name(stem: str, suffix: str) -> str:
    """`ffn_gate` + `weight` -> `gate`; `ffn_down` + `bias` -> `down.bias`."""
    base = stem[4:] if stem.startswith("ffn_") else stem
    return base if suffix == "weight" else f"{base}.{suffix}"


def classify(source: GGUFSource) -> Classification:
    arch = source.arch
    where = source.shards[0].path
    n_expert = _required_int(source, f"{arch}.expert_count", where)
    n_layer = _required_int(source, f"{arch}.block_count", where)

    legacy = [t.name for t in source.tensors if LEGACY_EXPERT_TENSOR.match(t.name)]
    if legacy:
        raise ClassifyError(
            f"{where}: per-expert tensors in the legacy one-tensor-per-expert layout ({legacy[0]}, ...); "
            "re-convert the model with a current llama.cpp, which stacks experts into *_exps tensors"
        )

    experts: list[ExpertTensor] = []
    trunk: list[SourceTensor] = []
    for t in source.tensors:
        match = EXPERT_TENSOR.match(t.name)
        if match is None or (len(t.shape) == 1 and t.shape[0] != n_expert):
            # A 1-D *_exps tensor that is not one value per expert is shared (e.g. Arctic's
            # ffn_norm_exps, a norm over the expert path): it belongs to the trunk.
            trunk.append(t)
            continue
        experts.append(_expert_tensor(t, match, n_expert, n_layer, where))

    if not experts:
        if n_expert in (None, 0):
            raise DenseModelError(f"{where}: {arch} model has no routed experts; expertpack packs MoE models only")
        raise DenseModelError(
            f"{where}: no routed-expert tensors (blk.N.*_exps.*) although {arch}.expert_count is {n_expert}; "
            "expertpack packs MoE models only"
        )
    n_expert_used = _required_int(source, f"{arch}.expert_used_count", where)
    if not 0 < n_expert_used <= n_expert:
        raise ClassifyError(f"{where}: {arch}.expert_used_count is {n_expert_used}, not in 1..{n_expert}")

    # Within a layer, roles keep the order a sequential read of the source meets them: the builder
    # can then hash each block as its bytes stream past, with no read-back.
    experts.sort(key=lambda e: (e.layer, e.source.shard, e.source.offset))
    _check_unique_roles(experts, where)
    return Classification(arch, n_layer, n_expert, n_expert_used, tuple(experts), tuple(trunk))


def _expert_tensor(t: SourceTensor, match: re.Match[str], n_expert: int, n_layer: int, where: object) -> ExpertTensor:
    layer = int(match["layer"])
    if layer >= n_layer:
        raise ClassifyError(f"{where}: tensor {t.name} is in layer {layer} but the model has {n_layer} layers")
    if t.shape[-1] != n_expert:
        raise ClassifyError(
            f"{where}: tensor {t.name} looks per-expert but its outermost dimension is {t.shape[-1]}, "
            f"not the expert count {n_expert}; this layout is not supported"
        )
    block_size, type_size = block_sizes(t.ggml_type)
    per_expert_values = 1
    for d in t.shape[:-1]:
        per_expert_values *= d
    if per_expert_values % block_size:
        raise ClassifyError(f"{where}: tensor {t.name}: one expert's slice is not whole {t.type_name} blocks")
    return ExpertTensor(
        layer=layer,
        role=role_name(match["stem"], match["suffix"]),
        source=t,
        bytes_per_expert=per_expert_values // block_size * type_size,
    )


def _check_unique_roles(experts: list[ExpertTensor], where: object) -> None:
    seen: dict[tuple[int, str], str] = {}
    for e in experts:
        key = (e.layer, e.role)
        if key in seen:
            raise ClassifyError(f"{where}: tensors {seen[key]} and {e.source.name} both map to role {e.role}")
        seen[key] = e.source.name


def _required_int(source: GGUFSource, key: str, where: object) -> int:
    value = source.value(key)
    if value is None:
        if key.endswith(".expert_count") and not any(EXPERT_TENSOR.match(t.name) for t in source.tensors):
            raise DenseModelError(f"{where}: no {key} key and no *_exps tensors: a dense model; expertpack packs MoE models only")
        raise ClassifyError(f"{where}: metadata key {key} is missing; cannot lay out the experts without it")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ClassifyError(f"{where}: metadata key {key} should be an integer, found {value!r}")
    return value
