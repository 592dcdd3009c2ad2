"""Where a model runs when a worker spans several devices: a pipeline over contiguous layer ranges,
one range per device, the token embedding read by the first device (from pinned host memory on
GPUs) and the output norm and head on the last. `parse_devices` reads `--device` (`cuda`,
`cuda:0,cuda:1`, `cpu`, and for tests `cpu,cpu`); `split_layers` is the pure balance (trunk bytes
a layer holds plus the expert bytes it reads per token); a `Placement` puts each trunk tensor on
its layer's device and moves a step's state (the hidden state and whatever else the layers carry:
positions' cos/sin, hyper-connection streams, banked residuals, token ids) across a boundary once
per step. It never sees experts' bytes, slots or sockets; on one device every call here is a no-op."""

from __future__ import annotations

import bisect
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator, Mapping, Sequence

import torch

from ..weights.model_files import ModelFiles, expert_layers
from ..weights.qtensor import QTensor
from ..weights.quant_iq import kernel_tables
from .backend import ops_for
from .ops import TorchOps


class DeviceSpecError(ValueError):
    """A `--device` value that names no usable set of devices; one line, for exit status 2."""


_ITEM = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_devices(spec: str, n_cuda: int) -> tuple[torch.device, ...]:
    """`cpu`, `cuda`, `cuda:N`, or a comma-separated list of `cuda:N` (one worker over several
    GPUs) or of `cpu` (the same split in one CPU process: tests). `n_cuda`: the CUDA devices this
    process sees (torch.cuda.device_count()). Raises DeviceSpecError naming what is wrong."""
    items = [s.strip() for s in spec.split(",")]
    expected = f"--device {spec!r}: expected cpu, cuda or cuda:N, or a list of GPUs such as cuda:0,cuda:1"
    if not spec.strip() or any(not s for s in items):
        raise DeviceSpecError(expected)
    devices = []
    for item in items:
        m = _ITEM.match(item)
        if m is None:
            try:
                other = torch.device(item).type
            except RuntimeError:
                raise DeviceSpecError(expected) from None
            raise DeviceSpecError(f"--device {spec!r}: expert-worker runs on cpu or cuda, not {other}")
        kind, index = m.group(1), m.group(2)
        if kind == "cpu" and index not in (None, "0"):
            raise DeviceSpecError(f"--device {spec!r}: {item!r}: the CPU has no numbered devices; write cpu")
        if kind == "cuda" and index is None and len(items) > 1:
            raise DeviceSpecError(f"--device {spec!r}: name each GPU of a list by its index (cuda:0,cuda:1)")
        devices.append(torch.device(kind) if kind == "cpu" or index is None else torch.device(kind, int(index)))
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise DeviceSpecError(f"--device {spec!r}: mixes cpu and cuda; a worker spans GPUs or runs on the CPU")
    if devices[0].type == "cuda":
        if n_cuda == 0:
            raise DeviceSpecError(f"--device {spec}: no CUDA device is usable here (torch {torch.__version__}, "
                                  f"CUDA build {torch.version.cuda or 'none'}); use --device cpu")
        indices = [d.index for d in devices if d.index is not None]
        seen = {i for i in indices if indices.count(i) > 1}
        if seen:
            raise DeviceSpecError(f"--device {spec}: cuda:{min(seen)} is named twice; each GPU holds one range "
                                  f"of layers")
        beyond = [i for i in indices if i >= n_cuda]
        if beyond:
            raise DeviceSpecError(f"--device {spec}: cuda:{beyond[0]} is not visible: this process sees {n_cuda} "
                                  f"CUDA devices (cuda:0..cuda:{n_cuda - 1})")
    return tuple(devices)


def device_spec(devices: Sequence[torch.device]) -> str:
    """The canonical --device value of `devices` (parse_devices' inverse)."""
    return ",".join(str(d) for d in devices)


@dataclass(frozen=True)
class LayerCost:
    trunk_bytes: int  # the layer's trunk tensors (attention, norms, router, shared experts), held on its device
    expert_bytes: int  # routed-expert bytes the layer reads per token (top-k blocks; 0 for a dense layer)

    @property
    def total(self) -> int:
        return self.trunk_bytes + self.expert_bytes


def split_layers(costs: Sequence[int], n_parts: int, first_extra: int = 0, last_extra: int = 0) -> tuple[range, ...]:
    """Contiguous, non-empty ranges covering layers 0..len(costs)-1 in order, one per part, that
    minimize the largest part's cost (the sum of its layers' costs, plus `first_extra` on the first
    part and `last_extra` on the last: the embedding and the head). Exact (dynamic programming over
    split points); among equal optima the earliest splits win, so the answer is deterministic."""
    n = len(costs)
    if n_parts < 1:
        raise ValueError(f"cannot split {n} layers into {n_parts} parts")
    if n_parts > n:
        raise ValueError(f"{n_parts} devices for a model of {n} layers: each device needs at least one layer; "
                         f"name at most {n} devices")
    prefix = [0]
    for c in costs:
        if c < 0:
            raise ValueError(f"a layer cost is negative: {c}")
        prefix.append(prefix[-1] + c)

    def part(k: int, start: int, end: int) -> int:  # part k holds layers start..end-1
        return (prefix[end] - prefix[start] + (first_extra if k == 0 else 0)
                + (last_extra if k == n_parts - 1 else 0))

    # best[k][j]: the least possible largest cost when parts 0..k hold layers 0..j-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_parts)]
    cut = [[0] * (n + 1) for _ in range(n_parts)]
    for j in range(1, n + 1):
        best[0][j] = part(0, 0, j)
    for k in range(1, n_parts):
        for j in range(k + 1, n + 1):
            for i in range(k, j):  # part k holds i..j-1
                value = max(best[k - 1][i], part(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    ends = [n]
    for k in range(n_parts - 1, 0, -1):
        ends.append(cut[k][ends[-1]])
    bounds = [0] + ends[::-1]
    return tuple(range(bounds[k], bounds[k + 1]) for k in range(n_parts))


def layer_costs(trunk: Mapping[str, QTensor], n_layer: int, expert_bytes: Mapping[int, int]) -> list[LayerCost]:
    """Each layer's cost from the trunk's `blk.N.*` tensors and the experts it reads per token
    (`expert_bytes`: MoE layer -> top-k x block bytes)."""
    trunk_bytes = [0] * n_layer
    for name, t in trunk.items():
        layer = tensor_layer(name)
        if layer is not None and layer < n_layer:
            trunk_bytes[layer] += t.raw.numel()
    return [LayerCost(trunk_bytes[i], expert_bytes.get(i, 0)) for i in range(n_layer)]


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def tensor_layer(name: str) -> int | None:
    """The layer a GGUF tensor name belongs to (`blk.N.`), None for the model's own tensors."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Placement:
    """Layer ranges over devices. `starts[k]` is the first layer on `devices[k]`; layers before
    starts[0] do not exist (it is 0). The token embedding lives on the first device, every other
    tensor outside the blocks (output norm, head, DeepSeek-V4's head hyper-connection) on the last."""

    devices: tuple[torch.device, ...]
    starts: tuple[int, ...]

    @classmethod
    def single(cls, device: torch.device) -> "Placement":
        return cls((device,), (0,))

    @classmethod
    def over(cls, devices: Sequence[torch.device], ranges: Sequence[range]) -> "Placement":
        if len(devices) != len(ranges) or not ranges or ranges[0].start != 0 or any(
                a.stop != b.start or len(a) == 0 for a, b in zip(ranges, ranges[1:])) or len(ranges[-1]) == 0:
            raise ValueError(f"ranges {list(ranges)} are not contiguous non-empty ranges from layer 0, one per device "
                             f"of {[str(d) for d in devices]}")
        return cls(tuple(devices), tuple(r.start for r in ranges))

    @cached_property
    def ops(self) -> TorchOps:
        """The ops every layer runs (the devices are of one kind: parse_devices), chosen once, as the
        model loads onto them. With the kernels, the i-quants' tables go to every device now, never
        first inside a CUDA graph's capture (keyed as tensors name their device: cuda:N)."""
        ops = ops_for(self.first)
        if ops.kernels:
            for device in self.devices:
                kernel_tables(torch.empty(0, device=device).device)
        return ops

    @property
    def first(self) -> torch.device:
        return self.devices[0]

    @property
    def last(self) -> torch.device:
        return self.devices[-1]

    @property
    def split(self) -> bool:
        return len(self.devices) > 1

    def ranges(self, n_layer: int) -> tuple[range, ...]:
        bounds = (*self.starts, n_layer)
        return tuple(range(bounds[k], bounds[k + 1]) for k in range(len(self.devices)))

    def part_of(self, layer: int) -> int:
        return bisect.bisect_right(self.starts, layer) - 1

    def device_of(self, layer: int) -> torch.device:
        return self.devices[self.part_of(layer)]

    def tensor_device(self, name: str) -> torch.device:
        layer = tensor_layer(name)
        if layer is not None:
            return self.device_of(layer)
        return self.first if name.startswith("token_embd.") else self.last

    def weights(self, trunk: Mapping[str, QTensor]) -> dict[str, QTensor]:
        """Every trunk tensor on its device (a block's on its layer's), but on GPUs the token
        embedding in pinned host memory, where the first GPU reads a step's rows of it in place
        (TritonOps.rows): a step needs a row a token of a table of hundreds of MB, which in VRAM
        would take an expert cache's room. Placing regroups Q8_0 matrices on the GPU (QTensor.to),
        through temporaries of up to twice a matrix that torch's allocator keeps reserved: handed
        back here, before an expert cache sizes itself from the free memory."""
        placed = {name: t.pinned(self.ops.kernels) if self.embedding_on_host(name) else
                  t.to(self.tensor_device(name), self.ops.kernels) for name, t in trunk.items()}
        if any(d.type == "cuda" for d in self.devices):
            torch.cuda.empty_cache()
        return placed

    def embedding_on_host(self, name: str) -> bool:
        """Whether tensor `name` is the token embedding, kept in pinned host memory (`weights`)."""
        return _embedding_on_host(name, self.first)

    def on_layer(self, layer: int, t: QTensor) -> QTensor:
        """`t` where layer `layer` runs: for a tensor read by the layer before its own (the next
        block's input norm fused into the residual add of this one)."""
        device = self.device_of(layer)
        return t if t.raw.device == device else t.to(device, self.ops.kernels)

    def hop(self, layer: int, *state: Any) -> tuple[Any, ...]:
        """The step's state (tensors, lists of tensors, None, anything else as is) on the device of
        `layer`: copied where `layer` starts a range past the first, untouched elsewhere. Called at
        the top of every layer, so the state crosses each boundary once per step. On CUDA the
        current device becomes the range's, for kernels that launch on the current device."""
        if layer == 0 or layer not in self.starts:
            return state
        device = self.device_of(layer)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return tuple(_moved(s, device) for s in state)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a forward pass: it starts on the first device (the current CUDA device, where
        Triton launches its kernels, is made the first's) and leaves the current device as it found it."""
        if self.first.type != "cuda":
            yield
            return
        with torch.cuda.device(self.first):
            yield


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value


def _embedding_on_host(name: str, first: torch.device) -> bool:
    """The token embedding stays in pinned host memory where the first device is a GPU
    (Placement.weights)."""
    return name.startswith("token_embd.") and first.type == "cuda"


def plan(files: ModelFiles, devices: Sequence[torch.device]) -> Placement:
    """The placement of a model over `devices`: layer ranges balanced by split_layers on the bytes
    each layer holds and reads per token, the embedding counted on the first device where it is
    held there (not on GPUs: Placement.weights), the head and output norm on the last."""
    if len(devices) == 1:
        return Placement.single(devices[0])
    n_layer = int(files.metadata[f"{files.arch}.block_count"])
    top_k = int(files.metadata[f"{files.arch}.expert_used_count"])
    reads = {layer: top_k * files.experts.layout(layer).payload_bytes for layer in expert_layers(files)}
    costs = layer_costs(files.trunk, n_layer, reads)
    embd = sum(t.raw.numel() for name, t in files.trunk.items()
               if name.startswith("token_embd.") and not _embedding_on_host(name, devices[0]))
    head = sum(t.raw.numel() for name, t in files.trunk.items()
               if tensor_layer(name) is None and not name.startswith("token_embd."))
    return Placement.over(devices, split_layers([c.total for c in costs], len(devices), embd, head))
