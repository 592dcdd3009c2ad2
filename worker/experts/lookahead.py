"""What the MoE seam fetches ahead while a layer runs (issue 13, DESIGN "Speed"): for the next
LOOKAHEAD_LAYERS MoE layers the expert source may prefetch for (PrefetchingSource.ahead), the
experts of a layer whose routes are static (DeepSeek-V4's hash layers: a token-id table) exactly,
from the tokens, and for the others a prediction: the model's own router of that layer applied to
this layer's router input (the hidden state after this layer's attention). The residual stream
changes little from layer to layer, so the prediction holds several layers ahead; asking that
early keeps the disk's queue full while the layers between compute. LOOKAHEAD_LAYERS (as far as
the prefetch budget reaches, nearest first) is the depth that streamed fastest from a cold RAM
tier (bench/decode_streaming.py --lookahead, BENCHMARKS.md). It only decides what to fetch early;
every layer computes with the routing it computes when it runs."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .source import PrefetchingSource

# A model's routing of one layer: (layer, router input [T, D]) -> (expert ids [T, k], weights [T, k])
Router = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The lookahead's predictions at one layer: (later layer, its predicted ids [T, k]) for each, nearest first
Guesses = tuple[tuple[int, torch.Tensor], ...]

LOOKAHEAD_LAYERS = 6  # MoE layers ahead of the running one whose experts are asked for


def guess(target: int, x: torch.Tensor, router: Router | None, static_routes: Mapping[int, torch.Tensor],
          tokens: torch.Tensor | None) -> torch.Tensor | None:
    """Layer `target`'s experts (ids [T, k], on the device) as the lookahead predicts them from a
    router input `x` of an earlier layer: a static layer's from the tokens, the others' by their
    router on `x`; None where neither is known."""
    table = static_routes.get(target)
    if table is not None and tokens is not None:
        return table[tokens.to(table.device)]
    return None if router is None else router(target, x)[0]


def next_guesses(source: PrefetchingSource, layer: int, x: torch.Tensor, router: Router | None,
                 static_routes: Mapping[int, torch.Tensor], tokens: torch.Tensor | None) -> Guesses:
    """The experts (ids [T, k], left on the device) of each of the next MoE layers after `layer`
    that `source` prefetches for, as look_ahead finds them: a static layer's from the tokens, the
    others' by their router on `x`. A segmented decode step (engine.SegmentedDecode) computes them
    inside a graph (from its token buffer) and reads them with the layer's own routing in one host
    copy."""
    out = []
    for target in source.ahead(layer, LOOKAHEAD_LAYERS):
        ids = guess(target, x, router, static_routes, tokens)
        if ids is not None:
            out.append((target, ids))
    return tuple(out)


def look_ahead(source: PrefetchingSource, layer: int, x: torch.Tensor, router: Router | None,
               static_routes: Mapping[int, torch.Tensor], tokens: torch.Tensor | None) -> None:
    """Sends the prefetches for the layers after `layer`, nearest first (what the prefetch budget
    cuts is the furthest): static ones exactly, the others by their router on `x`; a decode step's
    ids come to the host in one copy, a prompt's experts in order of how many tokens chose them."""
    guesses = next_guesses(source, layer, x, router, static_routes, tokens)
    if not guesses:
        return
    if all(ids.shape[0] == 1 for _, ids in guesses):  # a decode step: k distinct experts a layer
        flat = torch.cat([ids.reshape(-1) for _, ids in guesses]).tolist()
        at = 0
        for target, ids in guesses:
            source.prefetch(target, flat[at:at + ids.numel()], running=layer)
            at += ids.numel()
        return
    for target, ids in guesses:
        experts, counts = ids.reshape(-1).unique(return_counts=True)
        # the experts most tokens chose first: a prefill's prefetch budget goes to those
        source.prefetch(target, experts[counts.argsort(descending=True, stable=True)].tolist(), running=layer)
