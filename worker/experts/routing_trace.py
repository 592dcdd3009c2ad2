"""Routing traces: the experts every token selected in every MoE layer, recorded while a model runs
(`expert-worker --trace FILE`, `expertpack eval --trace FILE`) and replayed by `expertpack bench
cache` to measure cache policies. The file format lives here, and nothing else: the recorder taps
ExpertFFN's routing log (one host copy of the ids per layer call, which ExpertFFN makes only
while a trace is on) and never touches the math. This module does not import torch.

Format (version 1): JSON lines, UTF-8. Line 1 is the header, an object:
    {"format": "expertpack-routing-trace", "version": 1, "arch": "qwen3moe", "n_layer": 48,
     "n_expert": 128, "n_expert_used": 8, "moe_layers": [0, 1, ...], "fingerprint": "<pack's or null>",
     "model": "<name of the pack directory or GGUF>", "created_utc": "2026-11-30T17:00:00Z"}
Every further line is one call of one MoE layer, an array [step, layer, ids]:
    [0, 3, [[17, 4, 99, 2, 60, 5, 81, 33], [12, 4, ...], ...]]
`step` counts forward passes from 0 (a prompt, or a prompt chunk, or one decode token); `ids` is
[T][k]: for each of the step's T tokens, the k experts it selected, in the router's order.
Calls appear in the order they ran (layers ascending within a step).

Why JSON lines: the worker appends a line per layer call while it serves and a killed worker leaves
a readable file (a torn last line is dropped by the reader); any language or `jq` reads it without
our code; an expert id costs 2-4 bytes, within 2x of a binary int16 array, and the file compresses
tenfold with gzip if kept."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

import numpy as np

FORMAT = "expertpack-routing-trace"
VERSION = 1

log = logging.getLogger("expertpack.trace")


class TraceError(ValueError):
    """A trace file that is not one, or breaks its own header; names the path and line."""


@dataclass(frozen=True)
class TraceHeader:
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    moe_layers: tuple[int, ...]
    fingerprint: str | None = None
    model: str = ""
    created_utc: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def n_keys(self) -> int:
        """Every (layer, expert) the model has: what a cache holding all of them would hold."""
        return len(self.moe_layers) * self.n_expert

    def to_json(self) -> str:
        d = {"format": FORMAT, "version": VERSION, **asdict(self)}
        d["moe_layers"] = list(self.moe_layers)
        return json.dumps(d, separators=(",", ":"))


@dataclass(frozen=True)
class LayerCall:
    step: int
    layer: int
    ids: np.ndarray  # [T, k] int32


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    calls: list[LayerCall]
    truncated: bool = False  # the last line was torn (a writer killed mid-line) and dropped

    @property
    def n_steps(self) -> int:
        return len({c.step for c in self.calls})

    @property
    def n_tokens(self) -> int:
        """Tokens run (each counted once, in the first MoE layer that saw it)."""
        first: dict[int, int] = {}
        for c in self.calls:
            first.setdefault(c.step, len(c.ids))
        return sum(first.values())


class TraceWriter:
    """Appends layer calls to a trace file. The step counter follows the calls: a layer at or below
    the previous call's layer starts a new forward pass (every architecture runs its MoE layers in
    ascending order, once per pass). The file is flushed at each new step and on close."""

    def __init__(self, path: Path | str, header: TraceHeader) -> None:
        self.path = Path(path)
        self.header = header
        self._moe = frozenset(header.moe_layers)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self._file.write(header.to_json() + "\n")
        self._file.flush()
        self._step = -1
        self._last_layer: int | None = None
        self.calls = 0

    def record(self, layer: int, ids: Any) -> None:
        """ids: [T, k] integers (a CPU tensor, an array or nested lists)."""
        if self._file is None:
            raise ValueError(f"{self.path}: trace already closed")
        if layer not in self._moe:
            raise ValueError(f"layer {layer} is not a MoE layer of this model ({sorted(self._moe)})")
        if self._last_layer is None or layer <= self._last_layer:
            self._step += 1
            self._file.flush()
        self._last_layer = layer
        rows = ids.tolist() if hasattr(ids, "tolist") else [list(r) for r in ids]
        self._file.write(json.dumps([self._step, layer, rows], separators=(",", ":")) + "\n")
        self.calls += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LayerTap:
    """What ExpertFFN appends a layer's ids to: the writer, instead of a list."""

    __slots__ = ("writer", "layer")

    def __init__(self, writer: TraceWriter, layer: int) -> None:
        self.writer, self.layer = writer, layer

    def append(self, ids: Any) -> None:
        self.writer.record(self.layer, ids)


class RoutingTap(dict):
    """Stands in for ExpertFFN.routing_log (layer -> list of ids per call), whose only use there is
    `routing_log.setdefault(layer, []).append(ids.cpu())`: each append goes straight to the writer,
    so nothing accumulates in memory however long the worker serves."""

    def __init__(self, writer: TraceWriter) -> None:
        super().__init__()
        self.writer = writer

    def setdefault(self, layer: int, default: Any = None) -> _LayerTap:  # type: ignore[override]
        return _LayerTap(self.writer, int(layer))


def header_for(engine: Any, model: str = "") -> TraceHeader:
    """The header of a trace of this engine's model (torch is loaded by then)."""
    from ..weights.model_files import expert_layers

    files = engine.files
    cache = engine.expert_cache
    if cache is not None:  # the pack's own list; the files' expert source is the cache now
        info = cache.manifest.model
        moe_layers, n_expert = tuple(info.moe_layers), info.n_expert
    else:
        layers = expert_layers(files)
        moe_layers, n_expert = tuple(sorted(layers)), int(files.metadata[f"{files.arch}.expert_count"])
    return TraceHeader(arch=files.arch, n_layer=int(files.metadata[f"{files.arch}.block_count"]),
                       n_expert=n_expert, n_expert_used=int(files.metadata[f"{files.arch}.expert_used_count"]),
                       moe_layers=moe_layers, fingerprint=files.fingerprint, model=model)


def start_trace(engine: Any, path: Path | str, model: str = "") -> TraceWriter:
    """Records every MoE layer call of `engine` from now on into `path`; close the writer (or call
    stop_trace) when done. While it records, the decode step runs eagerly (no CUDA graph: the
    graph could not hold the host copy), which changes no result."""
    writer = TraceWriter(path, header_for(engine, model))
    engine.model.moe.routing_log = RoutingTap(writer)
    return writer


def stop_trace(engine: Any, writer: TraceWriter) -> None:
    if isinstance(engine.model.moe.routing_log, RoutingTap):
        engine.model.moe.routing_log = None
    writer.close()


def read_trace(path: Path | str) -> Trace:
    """Reads and checks a trace: the header, then every call against it (known MoE layer, ids in
    range, k experts per token). A torn last line is dropped (Trace.truncated); anything else
    malformed raises TraceError naming the line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    torn_tail = lines[-1] != ""  # a complete file ends with a newline
    if not torn_tail:
        lines.pop()
    if not lines or not lines[0]:
        raise TraceError(f"{path}: empty; not a routing trace")
    header = _header(path, lines[0])
    moe = frozenset(header.moe_layers)
    calls: list[LayerCall] = []
    truncated = False
    for n, line in enumerate(lines[1:], start=2):
        last = n == len(lines)
        try:
            step, layer, rows = json.loads(line)
            ids = np.asarray(rows, dtype=np.int64)
        except (ValueError, TypeError) as exc:
            if last and torn_tail:
                truncated = True
                log.warning("%s: the last line is torn (a writer stopped mid-line); dropped", path)
                break
            raise TraceError(f"{path}:{n}: not a [step, layer, ids] record ({exc})") from None
        if layer not in moe:
            raise TraceError(f"{path}:{n}: layer {layer} is not among the header's MoE layers")
        if ids.ndim != 2 or ids.shape[1] != header.n_expert_used or len(ids) == 0:
            raise TraceError(f"{path}:{n}: ids must be [T, {header.n_expert_used}], got shape {list(ids.shape)}")
        if ids.min() < 0 or ids.max() >= header.n_expert:
            raise TraceError(f"{path}:{n}: expert ids must lie in 0..{header.n_expert - 1}, "
                             f"found {int(ids.min())}..{int(ids.max())}")
        if calls and step < calls[-1].step:
            raise TraceError(f"{path}:{n}: step {step} after step {calls[-1].step}")
        calls.append(LayerCall(int(step), int(layer), ids.astype(np.int32)))
    return Trace(header, calls, truncated)


def _header(path: Path, line: str) -> TraceHeader:
    try:
        d = json.loads(line)
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise TraceError(f"{path}: not a routing trace (its first line is no {FORMAT} header)")
    if d.get("version") != VERSION:
        raise TraceError(f"{path}: trace version {d.get('version')!r}; this build reads version {VERSION}")
    try:
        return TraceHeader(arch=str(d["arch"]), n_layer=int(d["n_layer"]), n_expert=int(d["n_expert"]),
                           n_expert_used=int(d["n_expert_used"]), moe_layers=tuple(int(l) for l in d["moe_layers"]),
                           fingerprint=d.get("fingerprint"), model=str(d.get("model", "")),
                           created_utc=str(d.get("created_utc", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{path}: header lacks or garbles {exc}") from None


def unique_experts(calls: Sequence[LayerCall]) -> Iterator[tuple[int, list[int]]]:
    """(layer, sorted unique experts) per call: what the expert cache is asked for at once."""
    for c in calls:
        yield c.layer, np.unique(c.ids).tolist()
