"""Quantized blocks for the dequantization and kernel tests: random ones (valid, or raw bytes) and
gguf-py's reference dequantization of them."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from expertpack.packtools.synth.quant_fill import SCALES as FILLABLE, RandomFill

SHAPES = [(256,), (512, 3), (256, 7, 2), (1024, 1), (768, 5)]


def reference(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> np.ndarray:
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[1:], dtype=np.int64)))  # [rows, row_bytes]
    out = quants.dequantize(rows, ggml_type)
    return out.reshape(tuple(reversed(shape)))


def random_bytes(ggml_type: T, shape: tuple[int, ...], seed: int, valid: bool) -> np.ndarray:
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    nbytes = int(np.prod(shape)) // block_values * block_bytes
    if valid and ggml_type in FILLABLE:
        return RandomFill(seed).quant(ggml_type, nbytes).copy()
    if valid:  # float types: finite values
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(int(np.prod(shape)), dtype=np.float32)
        return {T.F32: values, T.F16: values.astype(np.float16),
                T.BF16: (values.view(np.uint32) >> 16).astype(np.uint16)}[ggml_type].view(np.uint8)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
