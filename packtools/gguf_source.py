"""Opens a source GGUF, one file or a llama.cpp split set given its first shard, through gguf-py's
reader, and describes it as plain data: shards, metadata fields and tensors with absolute file
offsets. It checks everything that can be checked without reading tensor data (shard count, order,
identity, tensor ranges inside each file) and never reads tensor bytes itself: a build gets them
from the reader `open_shard` hands out (a subclass, synth's SynthSource, makes them instead)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import SourceError
from .quants import block_sizes
from .source_pass import FileReader, ShardReader

# llama.cpp's split naming (llama_split_path): <prefix>-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
# Fields gguf-py's reader synthesises from the file header; they are not metadata keys.
READER_PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


@dataclass(frozen=True, slots=True)
class Shard:
    path: Path
    size_bytes: int
    mtime_ns: int
    ctime_ns: int  # changes with any write or rename; unlike mtime, no tool can set it back
    inode: int


@dataclass(frozen=True, slots=True)
class MetadataField:
    """One GGUF key/value with its exact wire type, so it can be written back unchanged."""

    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True, slots=True)
class SourceTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml ne order: shape[0] is the contiguous (quantized) row
    nbytes: int
    shard: int  # index into GGUFSource.shards
    offset: int  # absolute byte offset of the tensor data in its shard file

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass(frozen=True)
class GGUFSource:
    shards: tuple[Shard, ...]
    metadata: dict[str, MetadataField]  # first shard's keys, without split.* and reader pseudo-keys
    tensors: tuple[SourceTensor, ...]  # in (shard, offset) order: the order a sequential read meets them
    alignment: int

    @property
    def arch(self) -> str:
        field = self.metadata.get("general.architecture")
        if field is None or not isinstance(field.value, str):
            raise SourceError(f"{self.shards[0].path}: no general.architecture key; not a model GGUF")
        return field.value

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    def value(self, key: str, default: Any = None) -> Any:
        field = self.metadata.get(key)
        return default if field is None else field.value

    def identity(self) -> list[dict[str, Any]]:
        """What must be unchanged for a killed build of this source to resume (file_identity)."""
        return file_identity(self.shards)

    def open_shard(self, index: int) -> ShardReader:
        """A reader of shard `index`'s bytes; the caller closes it."""
        return FileReader(self.shards[index].path)


def open_source(path: Path | str) -> GGUFSource:
    """Opens a single GGUF or a whole split set from its first shard; raises SourceError with the
    offending file named on any inconsistency."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    first = _read(path)
    count = _split_count(first, path)
    if count == 1:
        paths = [path]
        readers = [first]
    else:
        paths = _shard_paths(path, count)
        readers = [first] + [_read(p) for p in paths[1:]]
        _check_split_set(paths, readers, count)

    shards = tuple(_shard(p) for p in paths)
    tensors: list[SourceTensor] = []
    seen: dict[str, Path] = {}
    for index, (shard, reader) in enumerate(zip(shards, readers)):
        for t in reader.tensors:
            if t.name in seen:
                raise SourceError(f"{shard.path}: tensor {t.name} also appears in {seen[t.name]}")
            seen[t.name] = shard.path
            tensor = _tensor(t, index, shard)
            tensors.append(tensor)
    tensors.sort(key=lambda t: (t.shard, t.offset))
    _check_no_overlap(tensors, shards)
    return GGUFSource(
        shards=shards,
        metadata=_metadata(first, path),
        tensors=tuple(tensors),
        alignment=int(first.alignment),
    )


def _read(path: Path) -> GGUFReader:
    if path.stat().st_size == 0:
        raise SourceError(f"{path}: empty file, not a GGUF")
    try:
        return GGUFReader(path)
    except ValueError as exc:
        if "GGMLQuantizationType" in str(exc):
            raise SourceError(f"{path}: unknown ggml type ({exc}); this gguf version cannot read it") from exc
        reason = truncation(path) or f"not a valid GGUF file ({exc})"
        raise SourceError(f"{path}: {reason}") from exc
    except (OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as exc:
        reason = truncation(path) or f"not a valid or complete GGUF file ({type(exc).__name__}: {exc})"
        raise SourceError(f"{path}: {reason}") from exc


# GGUF value types -> bytes of one scalar (STRING = 8 and ARRAY = 9 are read apart).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def truncation(path: Path) -> str | None:
    """Why gguf-py could not read `path`, in words, when the reason is that the file is cut short:
    inside its header, or before the end of the tensor data its header describes. None when the
    file is not a GGUF at all or is complete (the reader's own message then stands)."""
    raw = path.read_bytes()[: 64 << 20]  # headers are far smaller; bounded for a hostile file
    size = path.stat().st_size
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(raw):
            raise EOFError
        at += n
        return raw[at - n:at]

    def u32() -> int:
        return int.from_bytes(take(4), "little")

    def u64() -> int:
        return int.from_bytes(take(8), "little")

    def skip_value(vtype: int) -> int | None:
        if vtype == 8:
            take(u64())
            return None
        if vtype == 9:
            sub, count = u32(), u64()
            for _ in range(count):
                skip_value(sub)
            return None
        if vtype not in _SCALAR_BYTES:
            raise ValueError
        return int.from_bytes(take(_SCALAR_BYTES[vtype]), "little")

    if raw[:4] != b"GGUF"[:len(raw[:4])]:
        return None  # not a GGUF (or a cut one): the reader's message stands
    try:
        take(4)
        u32()  # version
        n_tensors, n_kv = u64(), u64()
        alignment = 32
        for _ in range(n_kv):
            key = take(u64())
            value = skip_value(u32())
            if key == b"general.alignment" and value:
                alignment = value
        end = 0
        for _ in range(n_tensors):
            name = take(u64()).decode("utf-8", "replace")
            dims = [u64() for _ in range(u32())]
            ggml_type, offset = u32(), u64()
            block, type_size = block_sizes(GGMLQuantizationType(ggml_type))
            n = int(np.prod(dims, dtype=np.float64))
            if offset + n // block * type_size > end:
                end, last = offset + n // block * type_size, name
        data_start = -(-at // alignment) * alignment
    except EOFError:
        return f"truncated inside its GGUF header (the file ends at byte {size:,}); copy or download it again"
    except (ValueError, OverflowError):
        return None
    if data_start + end > size:
        return (f"truncated: its GGUF tensors end at byte {data_start + end:,} (the last is {last}) but the file has "
                f"{size:,} bytes; copy or download it again")
    return None


def _shard(path: Path) -> Shard:
    st = path.stat()
    return Shard(path=path.resolve(), size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                 inode=st.st_ino)


def _tensor(t: Any, shard_index: int, shard: Shard) -> SourceTensor:
    ggml_type = GGMLQuantizationType(int(t.tensor_type))
    shape = tuple(int(d) for d in t.shape)
    block_size, type_size = block_sizes(ggml_type)
    if shape[0] % block_size:
        raise SourceError(
            f"{shard.path}: tensor {t.name} has rows of {shape[0]} values, not a multiple of "
            f"{ggml_type.name}'s block of {block_size}"
        )
    nbytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
    offset = int(t.data_offset)
    if offset + nbytes > shard.size_bytes:
        raise SourceError(
            f"{shard.path}: truncated: tensor {t.name} needs bytes [{offset}, {offset + nbytes}) "
            f"but the file has {shard.size_bytes}"
        )
    return SourceTensor(t.name, ggml_type, shape, nbytes, shard_index, offset)


def _check_no_overlap(tensors: list[SourceTensor], shards: tuple[Shard, ...]) -> None:
    """Tensor data ranges must be disjoint; the sequential copy relies on it."""
    for a, b in zip(tensors, tensors[1:]):
        if a.shard == b.shard and a.offset + a.nbytes > b.offset:
            raise SourceError(f"{shards[a.shard].path}: tensors {a.name} and {b.name} overlap in the file")


def _split_count(reader: GGUFReader, path: Path) -> int:
    count_field = reader.get_field("split.count")
    if count_field is None:
        return 1
    count = int(count_field.contents())
    no = int(reader.get_field("split.no").contents()) if reader.get_field("split.no") else 0
    if count > 1 and no != 0:
        raise SourceError(f"{path}: this is shard {no + 1} of {count}; pass the first shard (…-00001-of-…)")
    return count


def _shard_paths(first: Path, count: int) -> list[Path]:
    match = SPLIT_NAME.match(first.name)
    if match is None:
        raise SourceError(
            f"{first}: split.count is {count} but the name does not follow llama.cpp's "
            f"'<prefix>-00001-of-{count:05d}.gguf' pattern, so the other shards cannot be found"
        )
    if int(match["count"]) != count:
        raise SourceError(f"{first}: name says {int(match['count'])} shards but split.count is {count}")
    paths = [first.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SourceError(f"{first}: split set of {count} shards is incomplete; missing {', '.join(missing)}")
    return paths


def _check_split_set(paths: list[Path], readers: list[GGUFReader], count: int) -> None:
    total = _field_int(readers[0], "split.tensors.count", paths[0])
    for index, (p, r) in enumerate(zip(paths, readers)):
        no = _field_int(r, "split.no", p)
        this_count = _field_int(r, "split.count", p)
        this_total = _field_int(r, "split.tensors.count", p)
        if no != index or this_count != count:
            raise SourceError(f"{p}: says it is shard {no + 1} of {this_count}, expected shard {index + 1} of {count}")
        if this_total != total:
            raise SourceError(
                f"{p}: belongs to a different model (split.tensors.count {this_total}, first shard says {total})"
            )
    found = sum(len(r.tensors) for r in readers)
    if found != total:
        raise SourceError(f"{paths[0]}: split set holds {found} tensors but its header promises {total}")


def _field_int(reader: GGUFReader, key: str, path: Path) -> int:
    field = reader.get_field(key)
    if field is None:
        raise SourceError(f"{path}: missing {key}; not a shard of a llama.cpp split set")
    return int(field.contents())


def read_metadata(path: Path) -> dict[str, MetadataField]:
    """The metadata of the GGUF at `path` as open_source gives it (a file of a header and no tensors
    will do): how synth learns the values a build of its file would copy, float32 rounding included."""
    return _metadata(_read(path), path)


def _metadata(reader: GGUFReader, path: Path) -> dict[str, MetadataField]:
    out: dict[str, MetadataField] = {}
    for key, field in reader.fields.items():
        if key in READER_PSEUDO_KEYS or key in SPLIT_KEYS:
            continue
        types = list(field.types)
        if types[0] == GGUFValueType.ARRAY and len(types) == 1:  # gguf-py gives an empty array no item type
            out[key] = MetadataField(key, [], GGUFValueType.ARRAY, None)
        elif types[0] == GGUFValueType.ARRAY:
            if len(types) != 2:
                raise SourceError(f"{path}: metadata key {key} is a nested array, which gguf-py cannot round-trip")
            out[key] = MetadataField(key, field.contents(), GGUFValueType.ARRAY, types[1])
        else:
            out[key] = MetadataField(key, field.contents(), types[0])
    return out


def file_identity(shards: tuple[Shard, ...]) -> list[dict[str, Any]]:
    """What the resume logic compares to decide the source is unchanged since a killed build: a file
    replaced by another of the same size and mtime (`cp -p`, `rsync -a`) still has a new ctime."""
    return [{"name": s.path.name, "size_bytes": s.size_bytes, "mtime_ns": s.mtime_ns, "ctime_ns": s.ctime_ns,
             "inode": s.inode} for s in shards]

