"""Writes GGUF files whose tensor data is too large to hold in memory: gguf-py's GGUFWriter writes
the header, metadata and tensor infos, and this module returns where each tensor's data goes so the
caller can stream bytes there with pwrite. Offsets follow GGUFWriter's own rule (each tensor padded
to the alignment); the tests read every written file back with gguf-py's reader to hold us to it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .gguf_source import MetadataField
from .units import round_up

ARCH_KEY = "general.architecture"
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32

# GGUFWriter logs one INFO line per file it opens; our own progress output says the same better.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml ne order
    ggml_type: GGMLQuantizationType
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    data_start: int
    offsets: dict[str, int]  # tensor name -> absolute offset of its data
    size_bytes: int  # the complete file, last tensor padded like GGUFWriter pads it


def write_header(
    path: Path,
    arch: str | None,
    metadata: Iterable[MetadataField],
    tensors: Sequence[TensorInfo],
) -> GGUFLayout:
    """Writes magic, metadata and tensor infos to `path` (truncating it) and returns the data layout.
    `arch` None leaves general.architecture out (llama.cpp's non-first split shards have none)."""
    writer = GGUFWriter(path, arch or "unused")
    if arch is None:
        del writer.kv_data[0][ARCH_KEY]
    alignment = DEFAULT_ALIGNMENT
    for field in metadata:
        if field.key == ARCH_KEY:
            if field.value != arch:
                raise ValueError(f"metadata says architecture {field.value!r} but the file is written as {arch!r}")
            continue
        if field.key == ALIGNMENT_KEY:
            alignment = int(field.value)
        writer.add_key_value(field.key, field.value, field.vtype, sub_type=field.sub_type)
    writer.data_alignment = alignment
    offsets: dict[str, int] = {}
    relative = 0
    for t in tensors:
        # Any non-uint8 dtype makes GGUFWriter take the shape as given (numpy order, reversed ne).
        writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        offsets[t.name] = relative
        relative += round_up(t.nbytes, alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    header_end = writer.fout[0].tell()
    writer.close()
    data_start = round_up(header_end, alignment)
    return GGUFLayout(
        data_start=data_start,
        offsets={name: data_start + rel for name, rel in offsets.items()},
        size_bytes=data_start + relative,
    )


def string_field(key: str, value: str) -> MetadataField:
    return MetadataField(key, value, GGUFValueType.STRING)
