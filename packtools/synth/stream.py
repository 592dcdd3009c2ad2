"""`expertpack synth --pack`: the GGUF `synth -o` would write, handed to `expertpack build` as a
source whose bytes are made while the build reads them, so the pack of a model larger than the disk
can hold twice (DeepSeek-V4-Flash: 147 GB of experts) is written without the GGUF ever existing.

SynthSource describes the file exactly as open_source describes a written one: the same shards,
tensors and offsets (write_header's layout), and the metadata parsed back from a header file by the
same reader, so the build copies the same trunk keys, source sizes and digests, and writes the same
three files. The bytes come from writer.py's own header and tensor_chunks, in file order: one
random sequence runs over the whole model, so a read that goes back (a resumed build) starts the
sequence again and makes everything before it anew. Memory stays at a few chunks; nothing but the
headers (a few MB, in a temporary directory) touches the disk."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..gguf_source import GGUFSource, MetadataField, Shard, SourceTensor, read_metadata
from ..gguf_stream import ALIGNMENT_KEY, DEFAULT_ALIGNMENT, write_header
from ..source_pass import ShardReader
from .quant_fill import RandomFill
from .writer import SynthOptions, SynthPlan, SynthShard, SynthTensor, plan_shards, plan_synth, shard_paths, \
    tensor_chunks

# The options that decide the bytes; the others (force, progress) do not, so a rerun that changes them
# still resumes.
IDENTITY_FIELDS = ("preset", "n_layer", "n_expert", "expert_type", "trunk_type", "expert_mix", "shards", "seed",
                   "routing_skew")
PACK_SUFFIX = ".expertpack"  # build's default_output: model.gguf -> model.expertpack


def source_name(out: Path) -> str:
    """The GGUF name a pack directory's manifest records for its synthetic source: the one whose
    default build output `out` is (q12.expertpack <- q12.gguf; any other name gets .gguf added),
    so that `synth --pack OUT` writes what `synth -o NAME && build NAME -o OUT` writes."""
    name = out.resolve().name
    return name.removesuffix(PACK_SUFFIX) + ".gguf"


@dataclass(frozen=True)
class _ShardImage:
    """One file of the model: its header bytes (zero padded to data_start), then its tensors at
    their offsets, each padded with zeros to the file's alignment."""

    header: bytes
    tensors: tuple[tuple[SynthTensor, int], ...]  # (tensor, absolute offset), in file order
    size_bytes: int


class _ModelBytes:
    """Every byte of every shard, made front to back on demand. One position, shared by the readers
    of all shards: reading on from where the last read ended costs only the new bytes; a read that
    starts earlier, or in an earlier shard, makes the model again from its first byte."""

    def __init__(self, plan: SynthPlan, images: tuple[_ShardImage, ...]) -> None:
        self.plan = plan
        self.images = images
        self._pieces: Iterator[tuple[int, int, memoryview]] = iter(())
        self._piece: tuple[int, int, memoryview] | None = None  # the current piece, maybe partly read
        self._at = (len(images), 0)  # (shard, offset) of the next byte made: nothing yet

    def _restart(self) -> None:
        self._pieces = self._make()
        self._piece = None
        self._at = (0, 0)

    def _make(self) -> Iterator[tuple[int, int, memoryview]]:
        """(shard, offset, bytes) pieces covering every shard in order: the whole model."""
        fill = RandomFill(self.plan.seed)
        for index, image in enumerate(self.images):
            yield index, 0, memoryview(image.header)
            at = len(image.header)
            for t, offset in image.tensors:
                if offset > at:
                    yield index, at, memoryview(bytes(offset - at))
                for data in tensor_chunks(t, self.plan, fill):
                    yield index, offset, memoryview(data)
                    offset += data.nbytes
                at = offset
            if image.size_bytes > at:
                yield index, at, memoryview(bytes(image.size_bytes - at))

    def read_into(self, shard: int, buf: memoryview, at: int, want: int) -> int:
        """Bytes [at, at + want) of shard `shard` into buf; fewer only at the shard's end."""
        if (shard, at) < self._at:
            self._restart()
        try:
            return self._read_on(shard, buf, at, want)
        except BaseException:
            self._at = (len(self.images), 0)  # the sequence is broken off: the next read starts it again
            raise

    def _read_on(self, shard: int, buf: memoryview, at: int, want: int) -> int:
        filled = 0
        while filled < want:
            if self._piece is None:
                self._piece = next(self._pieces, None)
                if self._piece is None:
                    break
            index, offset, data = self._piece
            if index > shard:
                break  # the end of this shard
            pos = at + filled
            if index < shard or offset + len(data) <= pos:
                self._piece = None  # before the read: made and dropped
                continue
            lo = pos - offset
            n = min(len(data) - lo, want - filled)
            buf[filled:filled + n] = data[lo:lo + n]
            filled += n
            if lo + n == len(data):
                self._piece = None
        self._at = (shard, at + filled)
        return filled


class _ShardView:
    """A ShardReader of one shard of a _ModelBytes."""

    alignment = 1  # made bytes start anywhere: a resumed build reads on from where its digest stopped

    def __init__(self, model: _ModelBytes, index: int, name: str) -> None:
        self._model = model
        self._index = index
        self.name = f"{name} (synthesized, not on disk)"

    def read_into(self, buf: memoryview, at: int, want: int) -> int:
        return self._model.read_into(self._index, buf, at, want)

    def close(self) -> None:
        pass  # nothing is open: the position stays with the model, for the next shard's reader


@dataclass(frozen=True)
class SynthSource(GGUFSource):
    """The GGUF `write_synth(name, options)` would write, as open_source would describe it, read
    from a model made on demand."""

    options: SynthOptions
    header_sha256: tuple[str, ...]  # per shard: what a changed tokenizer or layout changes
    model: _ModelBytes

    def identity(self) -> list[dict[str, Any]]:
        """The bytes-deciding options and each shard's name, size and header: a killed `synth --pack`
        resumes only when rerun with the same of each."""
        synth = {k: v for k, v in asdict(self.options).items() if k in IDENTITY_FIELDS}
        return [{"synth": synth, "name": s.path.name, "size_bytes": s.size_bytes, "header_sha256": h}
                for s, h in zip(self.shards, self.header_sha256)]

    def open_shard(self, index: int) -> ShardReader:
        return _ShardView(self.model, index, self.shards[index].path.name)


def synth_source(options: SynthOptions, name: str) -> SynthSource:
    """The source of `write_synth(Path(name), options)`'s files, without writing them. Raises
    ExpertpackError for options write_synth would refuse."""
    plan = plan_synth(options)
    shards = plan_shards(plan, options.shards)
    names = shard_paths(Path(name), options.shards)
    images: list[_ShardImage] = []
    tensors: list[SourceTensor] = []
    with tempfile.TemporaryDirectory(prefix="expertpack-synth-") as tmp:
        for index, shard in enumerate(shards):
            header_path = Path(tmp) / f"header-{index}.gguf"
            layout = write_header(header_path, shard.arch, shard.metadata, shard.infos())
            header = header_path.read_bytes()
            images.append(_ShardImage(header.ljust(layout.data_start, b"\0"),
                                      tuple((t, layout.offsets[t.spec.name]) for t in shard.tensors),
                                      layout.size_bytes))
            tensors.extend(SourceTensor(t.spec.name, t.ggml_type, t.spec.shape, t.nbytes, index,
                                        layout.offsets[t.spec.name]) for t in shard.tensors)
        metadata = _metadata_as_read(shards[0], Path(tmp) / "metadata.gguf")
    alignment = metadata.get(ALIGNMENT_KEY)
    return SynthSource(
        shards=tuple(Shard(Path(n.name), image.size_bytes, 0, 0, 0) for n, image in zip(names, images)),
        metadata=metadata,
        tensors=tuple(tensors),
        alignment=int(alignment.value) if alignment else DEFAULT_ALIGNMENT,
        options=options,
        header_sha256=tuple(hashlib.sha256(image.header).hexdigest() for image in images),
        model=_ModelBytes(plan, tuple(images)),
    )


def _metadata_as_read(first: SynthShard, path: Path) -> dict[str, MetadataField]:
    """The first shard's metadata as open_source reads it from the file: written with no tensors (a
    header whose tensors are absent cannot be read) and parsed by the same reader, so that what the
    build copies into trunk.gguf is what it would copy from the file."""
    write_header(path, first.arch, first.metadata, [])
    return read_metadata(path)
