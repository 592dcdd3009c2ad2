"""What the MoE seam fetches ahead while a layer runs (issue 13, DESIGN "Speed"): for the next MoE
layers the expert source may prefetch for (PrefetchingSource.ahead), the experts of a layer whose
routes are static (DeepSeek-V4's hash layers: a token-id table) exactly, from the tokens, and for
the next layer otherwise a prediction: the model's own router of that layer applied to this
layer's router input (the hidden state after this layer's attention). It only decides what to
fetch early; every layer computes with the routing it computes when it runs."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .model_files import PrefetchingSource

# A model's routing of one layer: (layer, router input [T, D]) -> (expert ids [T, k], weights [T, k])
Router = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def next_guess(source: PrefetchingSource, layer: int, x: torch.Tensor, router: Router | None
               ) -> tuple[int, torch.Tensor] | None:
    """The next MoE layer after `layer` that `source` prefetches for and its router's choice on
    `x` (ids [T, k], left on the device), as look_ahead computes it; None where there is none.
    A segmented decode step (engine.SegmentedDecode) computes it inside a graph and sends it from
    the layer's boundary, with the layer's own routing read in the same host copy."""
    ahead = source.ahead(layer)
    if not ahead or router is None:
        return None
    return ahead[0], router(ahead[0], x)[0]


def look_ahead(source: PrefetchingSource, layer: int, x: torch.Tensor, router: Router | None,
               static_routes: Mapping[int, torch.Tensor], tokens: torch.Tensor | None) -> None:
    """Sends the prefetches for the layers after `layer`: static ones exactly (a layer or two
    ahead), the next one by its router on `x` (one host copy of the predicted ids per layer),
    each layer's experts in order of how many tokens chose them."""
    for depth, target in enumerate(source.ahead(layer)):
        table = static_routes.get(target)
        if table is not None and tokens is not None:
            ids = table[tokens.to(table.device)]  # [T, k]
        elif depth == 0 and router is not None:
            ids = router(target, x)[0]  # [T, k]
        else:
            continue
        if ids.shape[0] == 1:  # a decode step: k distinct experts, no order by count to make
            source.prefetch(target, ids.reshape(-1).tolist())
            continue
        experts, counts = ids.reshape(-1).unique(return_counts=True)
        # the experts most tokens chose first: a prefill's prefetch budget goes to those
        source.prefetch(target, experts[counts.argsort(descending=True, stable=True)].tolist())
