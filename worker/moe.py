"""The one MoE entry point, ExpertFFN(layer, h, ids, weights): asks the expert source for every
expert the tokens of this step selected (all of them, every time: top-k is never reduced, no expert
skipped or substituted), runs each on the tokens that chose it, and adds the weighted outputs.
Where expert weights come from (a pack, a GGUF, a VRAM cache fed by expertd) is the source's
business; what an expert computes is the architecture's (`expert_mlp`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .model_files import ExpertSource, ExpertWeights
from .weights import linear

ExpertMLP = Callable[[torch.Tensor, ExpertWeights], torch.Tensor]


def swiglu_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); a fused gate_up role holds gate's rows first, then up's."""
    if "gate_up" in w:
        gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w["gate"]), linear(x, w["up"])
    return linear(F.silu(gate) * up, w["down"])


class ExpertFFN:
    def __init__(self, source: ExpertSource, expert_mlp: ExpertMLP = swiglu_expert) -> None:
        self.source = source
        self.expert_mlp = expert_mlp
        self.routing_log: dict[int, list[torch.Tensor]] | None = None  # layer -> ids per call, when set
        # Layers whose experts follow from the token ids alone (DeepSeek-V4's hash layers): layer ->
        # table [n_vocab, k]. Their experts are known as soon as the tokens are, before the layer
        # runs: what a prefetcher can fetch ahead.
        self.static_routes: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, D], ids/weights [T, k] -> [T, D]."""
        if self.routing_log is not None:
            self.routing_log.setdefault(layer, []).append(ids.cpu())
        experts = sorted(set(ids.flatten().tolist()))
        out = torch.zeros_like(h)
        # A source with a capacity (a cache) gets the step in waves it can hold; each wave is
        # computed before the next is loaded. Every selected expert is computed either way.
        wave = getattr(self.source, "capacity", None) or len(experts) or 1
        for start in range(0, len(experts), wave):
            group = experts[start:start + wave]
            loaded = self.source.load(layer, group)
            for e in group:
                tokens, slots = (ids == e).nonzero(as_tuple=True)
                w = {role: t.to(h.device) for role, t in loaded[e].items()}
                y = self.expert_mlp(h[tokens], w)  # [n, D]
                out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
        return out
