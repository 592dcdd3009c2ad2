"""Skewed routing for synthetic models (`expertpack synth --routing-skew S`). With random routers
every expert of a layer is selected equally often, so any cache hits in proportion to its size;
real models reuse some experts far more than others. S > 0 gives each layer's experts a
Zipf-like popularity: in every layer a random permutation (from the seed and the layer) ranks
the experts, and the router row of the expert of rank r (0-based) is scaled by (r + 1) ** -S. The
router's logit for that expert then spreads that much less around zero, so it reaches the top-k
that much less often: rank 0 is chosen most, the tail rarely (how often depends on k and the
layer's width; `expertpack bench cache` on a trace measures it). Hash-routed layers (DeepSeek-V4's
tid2eid tables) draw their k experts per token with probabilities proportional to (r + 1) ** -S.
S = 0 changes nothing: the file is byte for byte what synth wrote before the option existed.
Draws come from their own generator, so every other tensor is the same at any S."""

from __future__ import annotations

import numpy as np

STREAM = 0x736B6577  # "skew": keeps these draws apart from the weights' generator


def _rng(seed: int, layer: int) -> np.random.Generator:
    return np.random.default_rng([seed, layer, STREAM])


def expert_gains(seed: int, layer: int, n_expert: int, skew: float) -> np.ndarray:
    """[n_expert] float32: the router row gain of each expert of `layer`, 1 for the most popular."""
    rank = np.empty(n_expert, dtype=np.int64)
    rank[_rng(seed, layer).permutation(n_expert)] = np.arange(n_expert)
    return ((rank + 1.0) ** -skew).astype(np.float32)


def skewed_expert_ids(seed: int, layer: int, n_expert: int, n_used: int, n_tokens: int, skew: float) -> np.ndarray:
    """[n_tokens, n_used] int32 distinct experts per token, drawn without replacement with
    probabilities proportional to the experts' gains (Gumbel top-k)."""
    log_p = np.log(expert_gains(seed, layer, n_expert, skew).astype(np.float64))
    rng = np.random.default_rng([seed, layer, STREAM, 1])
    keys = log_p - np.log(-np.log(rng.random((n_tokens, n_expert))))
    return np.argsort(-keys, axis=1)[:, :n_used].astype(np.int32)
