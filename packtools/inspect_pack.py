"""`expertpack inspect OUT|SRC.gguf`: what a user needs to plan a deployment, from a finished pack's
manifest or, without building, from a source GGUF's header: the model, its expert roles and types,
bytes per expert block, pack and trunk sizes, the routed bytes one token reads at 0% cache hit, and
how many experts fit in a given VRAM budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .layout import LayerLayout, Manifest
from .units import GIB, human_bytes

DEFAULT_VRAM_GIB = (8.0, 16.0, 24.0, 32.0, 80.0)


@dataclass(frozen=True)
class PackSummary:
    source: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    layers: tuple[LayerLayout, ...]
    pack_size_bytes: int
    trunk_size_bytes: int
    built: bool  # False: planned from a source GGUF, nothing written

    @property
    def max_stride(self) -> int:
        return max(l.stride for l in self.layers)

    def to_dict(self, vram_gib: Sequence[float]) -> dict[str, Any]:
        per_token_read = sum(self.n_expert_used * l.stride for l in self.layers)
        per_token_payload = sum(self.n_expert_used * l.payload_bytes for l in self.layers)
        n_total = len(self.layers) * self.n_expert
        return {
            "source": self.source,
            "built": self.built,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "moe_layers": [l.layer for l in self.layers],
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "roles": _role_groups(self.layers),
            "expert_payload_bytes": {"min": min(l.payload_bytes for l in self.layers),
                                     "max": max(l.payload_bytes for l in self.layers)},
            "expert_block_bytes": {"min": min(l.stride for l in self.layers), "max": self.max_stride},
            "n_experts_total": n_total,
            "pack_size_bytes": self.pack_size_bytes,
            "trunk_size_bytes": self.trunk_size_bytes,
            "routed_experts_per_token": len(self.layers) * self.n_expert_used,
            "routed_bytes_per_token": per_token_read,
            "routed_payload_bytes_per_token": per_token_payload,
            "min_cache_bytes": self.n_expert_used * self.max_stride,
            # a slot holds one expert block, sized for the largest; more slots than experts hold them all
            "cache_fit": [
                {"vram_gib": g, "slots": int(g * GIB) // self.max_stride,
                 "experts": min(n_total, int(g * GIB) // self.max_stride),
                 "fraction_of_experts": min(1.0, (int(g * GIB) // self.max_stride) / n_total)}
                for g in vram_gib
            ],
        }


def summarize(target: Path) -> PackSummary:
    """A pack directory (has manifest.json) or a source GGUF (planned, not built)."""
    if target.is_dir():
        m = Manifest.load(target)
        return PackSummary(str(target), m.model.arch, m.model.n_layer, m.model.n_expert, m.model.n_expert_used,
                           m.layers, m.pack_size_bytes, m.trunk.size_bytes, built=True)
    from .build_plan import plan_build  # reads the GGUF header; a pack needs only its manifest

    plan = plan_build(target)
    c = plan.classification
    return PackSummary(str(target), c.arch, c.n_layer, c.n_expert, c.n_expert_used, plan.layers,
                       plan.pack_size_bytes, plan.trunk_tensor_bytes, built=False)


def render_text(d: dict[str, Any]) -> str:
    lines = [
        f"{'pack' if d['built'] else 'source (not built; sizes are what a build writes)'}: {d['source']}",
        f"architecture      {d['arch']}",
        f"layers            {d['n_layer']} ({len(d['moe_layers'])} with routed experts: {_ranges(d['moe_layers'])})",
        f"experts           {d['n_expert']} per layer, top-{d['n_expert_used']}; {d['n_experts_total']:,} in all",
        "roles:",
    ]
    for group in d["roles"]:
        lines.append(f"  layers {_ranges(group['layers'])}: {_types(group['roles'])}; "
                     f"per expert {group['payload_bytes']:,} B payload, {group['block_bytes']:,} B on disk")
        for r in group["roles"]:
            shape = "x".join(str(x) for x in r["shape"])
            lines.append(f"    {r['role']:<12} {r['ggml_type']:<7} [{shape}]  {r['nbytes']:,} B at +{r['offset']}")
    pay, blk = d["expert_payload_bytes"], d["expert_block_bytes"]
    lines += [
        f"bytes per expert  {_span(pay)} payload, {_span(blk)} per block on disk (4096-aligned)",
        f"pack              {human_bytes(d['pack_size_bytes'])} ({d['pack_size_bytes']:,} B)",
        f"trunk             {human_bytes(d['trunk_size_bytes'])}{'' if d['built'] else ' of tensors'}"
        " (stays resident in VRAM)",
        f"per token at 0% cache hit: {d['routed_experts_per_token']:,} experts, "
        f"{human_bytes(d['routed_bytes_per_token'])} read from the SSD "
        f"({d['routed_bytes_per_token']:,} B; {d['routed_payload_bytes_per_token']:,} B of payload)",
        f"smallest cache    {d['n_expert_used']} slots = {human_bytes(d['min_cache_bytes'])} (one layer's selection)",
        f"expert cache fit (slots of {human_bytes(blk['max'])}, one expert block each):",
    ]
    for row in d["cache_fit"]:
        held = (f"all {d['n_experts_total']:,} experts" if row["experts"] == d["n_experts_total"] else
                f"{row['experts']:,} of the {d['n_experts_total']:,} experts ({100 * row['fraction_of_experts']:.2f}%)")
        lines.append(f"  {row['vram_gib']:>7g} GiB  {row['slots']:>9,} slots: {held}")
    return "\n".join(lines)


def _role_groups(layers: tuple[LayerLayout, ...]) -> list[dict[str, Any]]:
    """Layers with identical role tables are listed once, with the bytes of one expert of theirs:
    a mixed model (down at more bits, some layers at another type) shows one group per mix."""
    groups: dict[tuple, list[int]] = {}
    tables: dict[tuple, dict[str, Any]] = {}
    for l in layers:
        table = [{"role": r.role, "ggml_type": r.ggml_type, "shape": list(r.shape), "offset": r.offset,
                  "nbytes": r.nbytes} for r in l.roles]
        key = tuple((r["role"], r["ggml_type"], tuple(r["shape"]), r["offset"], r["nbytes"]) for r in table)
        groups.setdefault(key, []).append(l.layer)
        tables[key] = {"roles": table, "payload_bytes": l.payload_bytes, "block_bytes": l.stride}
    return [{"layers": groups[k], **tables[k]} for k in groups]


def _types(roles: list[dict[str, Any]]) -> str:
    """[gate IQ1_S, up IQ1_S, down IQ2_XXS] -> 'gate,up IQ1_S  down IQ2_XXS': roles of one type together."""
    by_type: dict[str, list[str]] = {}
    for r in roles:
        by_type.setdefault(r["ggml_type"], []).append(r["role"])
    return "  ".join(f"{','.join(names)} {t}" for t, names in by_type.items())


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: list[str] = []
    for v in sorted(values):
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def _span(d: dict[str, int]) -> str:
    return f"{d['min']:,} B" if d["min"] == d["max"] else f"{d['min']:,}-{d['max']:,} B"
