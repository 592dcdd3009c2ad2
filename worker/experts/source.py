"""What the MoE seam asks of wherever experts come from (a pack or GGUF read in this process, the
resident table, the VRAM cache fed by expertd): the protocols, and the two shapes experts are
handed over in. Types only; it imports neither the weights' decoding nor the kernels, so the
layers and the lookahead depend on the contract, not on a source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from expertpack.packtools.layout import LayerLayout

if TYPE_CHECKING:
    from ..weights.qtensor import QTensor

ExpertWeights = dict[str, "QTensor"]  # role ("gate", "up", "down", "gate_up", "down.bias", ...) -> tensor


@dataclass(frozen=True)
class ExpertRows:
    """Where the experts of a step's (token, slot) pairs sit, for the fused kernels: offsets
    [T*k] int64, bytes into `pool` (uint8, on the compute device), each the start of a block laid
    out as the source's `layout` says. `pairs` (int32) lists the pairs the offsets are valid for
    when a source delivers a step in waves; None means all of them."""
    pool: torch.Tensor
    offsets: torch.Tensor
    pairs: torch.Tensor | None = None


class ExpertSource(Protocol):
    """Gives the weights of the experts a layer selected: all of them, every time; as role tensors
    (`load`, the torch path) or as rows of blocks in device memory (`expert_rows`, the kernels)."""

    def load(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]: ...

    def layout(self, layer: int) -> LayerLayout: ...

    def expert_rows(self, layer: int, ids: torch.Tensor) -> Iterator[ExpertRows]: ...

    def close(self) -> None: ...


@runtime_checkable
class PrefetchingSource(ExpertSource, Protocol):
    """A source whose experts arrive from elsewhere (the expert cache fed by expertd): it can be
    told ahead which experts a later layer will likely need (prefetch.py), and when a layer has run."""

    def ahead(self, layer: int, depth: int) -> tuple[int, ...]: ...

    # `then`: what the step sends once its own misses are asked for (the later layers' prefetches)
    def load(self, layer: int, experts: Sequence[int], then: Callable[[], None] | None = None
             ) -> dict[int, ExpertWeights]: ...

    def expert_rows(self, layer: int, ids: torch.Tensor, then: Callable[[], None] | None = None
                    ) -> Iterator[ExpertRows]: ...

    def prefetch(self, layer: int, experts: Sequence[int], running: int | None = None) -> None: ...

    def layer_done(self, layer: int) -> None: ...
