"""The one MoE entry point, ExpertFFN(layer, h, ids, weights): every expert the tokens of this step
selected is computed (all of them, every time: top-k is never reduced, no expert skipped or
substituted) and the weighted outputs are added. Where expert bytes come from (a pack, a GGUF, the
resident table, a VRAM cache fed by expertd) is the source's business; what an expert computes is
the architecture's `Activation`, as data. Where the source fetches experts (the expertd-fed
cache), each call also sends what the layers ahead will likely need (lookahead.py), right behind
its own misses: never a change to what this call computes.

Two paths, one result within rounding: on CUDA (and on the CPU under Triton's interpreter, for
tests) the source hands the fused kernels a byte-offset map into its memory and every selected
expert runs in two launches (a long prefill: each expert dequantized once and multiplied by all its
tokens, kernels/moe_dense.py; a short one, each expert decoded once for a tile of its pairs,
kernels/moe_tiles.py); elsewhere each expert runs through `linear`, a torch loop kept as
the CPU path and the reference.

A segmented decode step (engine.SegmentedDecode: CUDA graphs split at the MoE layers) sets
`boundary`: a call then leaves the host work (the one read of the routing, the fetch of misses,
the offsets) to the boundary, between two graphs, and reads the offsets from the buffer it names;
`host_step` is that work, in the order an eager call does it."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..experts.lookahead import Guesses, Router, guess, look_ahead, next_guesses
from ..experts.source import ExpertRows, ExpertSource, ExpertWeights, PrefetchingSource
from ..weights.expert_roles import ExpertRoles, expert_roles
from .activation import SWIGLU, Activation
from .ops import TorchOps

if TYPE_CHECKING:
    from .triton_ops import TritonOps


def torch_expert(ops: TorchOps, x: torch.Tensor, w: ExpertWeights, act: Activation) -> torch.Tensor:
    """down(act(gate(x), up(x))) through `ops.linear`; a fused gate_up role holds gate's rows first."""
    if "gate_up" in w:
        gate, up = ops.linear(x, w["gate_up"], w.get("gate_up.bias")).chunk(2, dim=-1)
    else:
        gate, up = ops.linear(x, w["gate"], w.get("gate.bias")), ops.linear(x, w["up"], w.get("up.bias"))
    return ops.linear(act(gate, up), w["down"], w.get("down.bias"))


# Where a segmented decode step stops at an MoE layer: (layer, ids [T, k], the router's input [T, D],
# from which ExpertFFN.guesses / guess predict later layers' experts) -> where the layer's experts
# sit (offsets in a buffer of the step's own).
Boundary = Callable[[int, torch.Tensor, torch.Tensor], ExpertRows]

DENSE_MIN_PAIRS_PER_EXPERT = 6  # from this many pairs per routed expert, dequantize once and multiply (bench/moe_prefill.py)
# For experts moe_integer runs (Q4_K): from INTEGER_TILES_MIN_PAIRS_PER_EXPERT its products in tiles decoded on
# chip, from INTEGER_MIN_PAIRS_PER_EXPERT unpacked once into scratch. One Qwen3-30B-A3B layer on the H100
# (bench/moe_prefill.py, ms): 4 pairs an expert tiles 1.30 / integer_tiles 1.66; 8: 2.19 / 1.75 (dense 2.33,
# integer 2.11); 16: integer_tiles 2.47 / integer 2.12. Where the lines cross: 6 and 12.
INTEGER_TILES_MIN_PAIRS_PER_EXPERT = 6
INTEGER_MIN_PAIRS_PER_EXPERT = 12
TILES_MIN_PAIRS_PER_EXPERT = 2  # from this many, decode each expert once per tile of its pairs (moe_tiles)
# The same for `integer` experts, whose tiles take moe_tiles' Q4_K kernels: from one pair an expert (H100,
# resident Q3-12L: a step of 16 rows 10.26 ms in tiles of 2 pairs, 10.92 per pair; of 4 rows, a quarter of
# a pair an expert, 3.38 against 3.17).
Q4_K_TILES_MIN_PAIRS_PER_EXPERT = 1


def fused_path(ids: torch.Tensor, n_expert: int, grouped: bool = False, tiles: bool = True,
               integer: bool = False) -> str:
    """Which kernels run a step's experts: for MXFP4 experts (`grouped`: moe_grouped.decodes),
    "grouped" (products on tensor cores, each expert's bytes
    decoded once per tile of its pairs) from TILES_MIN_PAIRS_PER_EXPERT pairs per routed expert;
    otherwise, once the step has enough pairs per expert to repay unpacking each expert once,
    "integer" (moe_integer: float16 products of the quants, for experts it runs: `integer`) or
    "dense" (moe_dense: dequantized once, grouped products); for `integer` experts with fewer pairs
    than repay that but at least INTEGER_TILES_MIN_PAIRS_PER_EXPERT, "integer_tiles" (moe_integer's
    products in tiles of a few pairs, decoded on chip); "tiles" (moe_tiles: an expert's bytes
    decoded once per tile of its pairs) where experts are shared by a few pairs and `tiles` (their
    types decode well in tiles: not the i-quants, TritonOps.experts_tiled), and for `integer`
    experts (moe_tiles' Q4_K kernels) from one pair an expert, a batched decode step; else "per_pair"
    (moe_tl, a decode step). A function of the step's shape and the experts' types alone: no host
    sync, and every wave of a cache decides alike. The thresholds are where bench/moe_prefill.py
    and decode_settings.py find each path the fastest (BENCHMARKS.md)."""
    many = ids.shape[0] > 1 and ids.numel() >= TILES_MIN_PAIRS_PER_EXPERT * n_expert
    if grouped:
        return "grouped" if many else "per_pair"
    if integer and ids.numel() >= INTEGER_MIN_PAIRS_PER_EXPERT * n_expert:
        return "integer"
    if integer and ids.shape[0] > 1 and ids.numel() >= INTEGER_TILES_MIN_PAIRS_PER_EXPERT * n_expert:
        return "integer_tiles"
    if ids.numel() >= DENSE_MIN_PAIRS_PER_EXPERT * n_expert:
        return "dense"
    if integer and ids.shape[0] > 1 and ids.numel() >= Q4_K_TILES_MIN_PAIRS_PER_EXPERT * n_expert:
        return "tiles"
    return "tiles" if many and tiles else "per_pair"


class ExpertFFN:
    def __init__(self, ops: TorchOps, source: ExpertSource, n_expert: int,
                 activation: Activation | Sequence[Activation] = SWIGLU) -> None:
        """`ops`: the model's (the fused kernels where ops.kernels, else a torch loop); `n_expert`:
        routed experts per layer; `activation`: one for every layer, or one per layer (DeepSeek-V4's
        clamp varies)."""
        self.ops = ops
        self.source = source
        self.n_expert = n_expert
        self.activation = activation
        self.routing_log: dict[int, list[torch.Tensor]] | None = None  # layer -> ids per call, when set
        # Layers whose experts follow from the token ids alone (DeepSeek-V4's hash layers): layer ->
        # table [n_vocab, k]. Their experts are known as soon as the tokens are, before the layer
        # runs: what a prefetcher can fetch ahead.
        self.static_routes: dict[int, torch.Tensor] = {}
        # The model's routing of a layer, which the lookahead applies to a layer's router input to
        # predict the next layer's experts; set by models, used only when the source prefetches.
        self.router: Router | None = None
        # Look ahead: set by Engine.load (prefetch=...) where the source is the expertd-fed cache.
        self.prefetch = False
        self.tokens: torch.Tensor | None = None  # this pass's token ids, for static routes (begin)
        self.boundary: Boundary | None = None  # set by engine.SegmentedDecode and TableDecode for their passes
        self._roles: dict[int, ExpertRoles] = {}

    def begin(self, tokens: torch.Tensor) -> None:
        """A forward pass over `tokens` [T] starts: layers with static routes know their experts."""
        self.tokens = tokens

    def prepare(self, layers: Sequence[int]) -> None:
        """Reads the role table of every MoE layer for the fused kernels, so that experts they cannot
        run are refused when the model loads, not at its first token."""
        for layer in layers:
            self._roles[layer] = expert_roles(self.source.layout(layer))

    @property
    def prefetching(self) -> bool:
        return self.prefetch and isinstance(self.source, PrefetchingSource)

    def act(self, layer: int) -> Activation:
        return self.activation if isinstance(self.activation, Activation) else self.activation[layer]

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 summed: bool = True, router_in: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D], ids/weights [T, k] -> [T, D]; with summed=False the fused path leaves the k
        weighted outputs [T, k, D] for layers.add_rms_norm to add (in slot order, as the sum here).
        `router_in`: what the router read, where it is not `h` (Kimi-K3's experts take a latent)."""
        if self.routing_log is not None:
            self.routing_log.setdefault(layer, []).append(ids.cpu())
        prefetching = self.prefetching
        if self.boundary is not None:  # a segmented decode step: the host work waits for the boundary
            y = self._fused(layer, h, ids, weights, [self.boundary(layer, ids, h if router_in is None else router_in)])
            return y.sum(dim=1).to(h.dtype) if summed else y
        ahead = partial(look_ahead, self.source, layer, h if router_in is None else router_in, self.router,
                        self.static_routes, self.tokens) if prefetching else None
        if self.ops.kernels:
            y = self._fused(layer, h, ids, weights, then=ahead)  # the later layers' prefetches behind its misses
            y = y.sum(dim=1).to(h.dtype) if summed else y
        else:
            y = self._per_expert(layer, h, ids, weights, then=ahead)
        if prefetching:
            self.source.layer_done(layer)
        return y

    def guesses(self, layer: int, x: torch.Tensor) -> Guesses:
        """The lookahead's guesses (on the device) for the layers after `layer` the source
        prefetches for, from the layer's router input `x`: none where it does not prefetch."""
        if not self.prefetching:
            return ()
        return next_guesses(self.source, layer, x, self.router, self.static_routes, self.tokens)

    def guess(self, target: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layer `target`'s experts [T, k] as predicted from an earlier layer's router input `x`
        (lookahead.guess), None where they cannot be."""
        return guess(target, x, self.router, self.static_routes, self.tokens)

    def host_step(self, layer: int, chosen: list[int], guesses: Sequence[tuple[int, list[int]]]) -> list[int]:
        """A segmented decode step's host work at `layer`, what an eager call does around its
        kernels and in the same order: the experts `chosen` [T*k] acquired in one wave (the compute
        stream waiting on their copies), the later layers' guessed experts sent ahead as soon as
        this layer's misses are asked for, the layer's stale prefetches cancelled. -> the pairs'
        byte offsets [T*k] into the source's memory. Runs over the expert cache only
        (ExpertCache.waves), for steps it holds in one wave."""
        def send_ahead() -> None:
            for target, experts in guesses:
                self.source.prefetch(target, experts, running=layer)

        offsets, pairs = next(self.source.waves(layer, chosen, send_ahead if guesses else None))
        assert pairs is None, "a segmented step's experts are loaded in one wave"
        if self.prefetching:
            self.source.layer_done(layer)
        return offsets

    def _fused(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               rows: Sequence[ExpertRows] | None = None, then: Callable[[], None] | None = None) -> torch.Tensor:
        ops: TritonOps = self.ops  # type: ignore[assignment]  # _fused runs where ops.kernels
        t, k = ids.shape
        roles = self._roles.get(layer)
        if roles is None:
            self.prepare([layer])
            roles = self._roles[layer]
        x = h.to(torch.float32).contiguous()
        w = weights.to(torch.float32).reshape(-1).contiguous()
        # by the whole step: every wave alike
        path = fused_path(ids, self.n_expert, ops.experts_grouped(roles), ops.experts_tiled(roles),
                          ops.experts_integer(roles))
        run = ops.experts_runner(path, self.n_expert)
        y = None
        if rows is None:  # `then` comes with a prefetching source only (ExpertCache, CacheGroup)
            rows = self.source.expert_rows(layer, ids) if then is None else self.source.expert_rows(layer, ids, then)
        for wave in rows:
            y = run(x, wave.pool, wave.offsets, w, roles, self.act(layer), wave.pairs, out=y)
        return y.view(t, k, -1)  # summed over k in slot order by the caller: the same sum in every mode

    def _per_expert(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    then: Callable[[], None] | None = None) -> torch.Tensor:
        experts = sorted(set(ids.flatten().tolist()))
        out = torch.zeros_like(h)
        act = self.act(layer)
        # A source with a capacity (a cache) gets the step in waves it can hold; each wave is
        # computed before the next is loaded. Every selected expert is computed either way.
        wave = getattr(self.source, "capacity", None) or len(experts) or 1
        for start in range(0, len(experts), wave):
            group = experts[start:start + wave]
            loaded = self.source.load(layer, group) if then is None else self.source.load(layer, group, then)
            then = None
            for e in group:
                tokens, slots = (ids == e).nonzero(as_tuple=True)
                w = {role: t.to(h.device) for role, t in loaded[e].items()}
                y = torch_expert(self.ops, h[tokens], w, act)  # [n, D]
                out.index_add_(0, tokens, y * weights[tokens, slots, None].to(y.dtype))
        return out
