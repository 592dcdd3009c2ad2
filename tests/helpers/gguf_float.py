"""A GGUF's float reference: a copy whose chosen tensors are gguf-py's float32 dequantization of
them, every other tensor and key as it is. The engine run on that copy is what its own decoders
(torch's and the kernels') are held to on the original."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, quants

from expertpack.packtools.gguf_source import open_source
from expertpack.packtools.gguf_stream import TensorInfo, write_header
from expertpack.packtools.quants import nbytes_of

I_QUANTS = frozenset({T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
                      T.TQ1_0, T.TQ2_0})


def float_copy(src: Path, out: Path, chosen: Callable[[str, T], bool]) -> Path:
    """src with each tensor for which chosen(name, type) holds written as F32 (gguf-py's values)."""
    source = open_source(src)
    data = {t.name: t for t in GGUFReader(src).tensors}
    floats = {t.name for t in source.tensors if chosen(t.name, t.ggml_type)}
    infos = [TensorInfo(t.name, t.shape, T.F32, nbytes_of(T.F32, t.shape)) if t.name in floats else
             TensorInfo(t.name, t.shape, t.ggml_type, t.nbytes) for t in source.tensors]
    layout = write_header(out, source.arch, source.metadata.values(), infos)
    with open(out, "r+b") as f:
        f.truncate(layout.size_bytes)
        for info in infos:
            t = data[info.name]
            raw = quants.dequantize(t.data, t.tensor_type).astype(np.float32) if info.name in floats else t.data
            f.seek(layout.offsets[info.name])
            f.write(np.ascontiguousarray(raw).tobytes())
    return out
