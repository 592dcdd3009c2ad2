"""Random but valid tensor data for every ggml type synth writes, fast enough to write at disk speed.

Any bit pattern is a valid quant code; only the floating-point scale fields need care (finite, small,
so activations stay in range). Bytes come from a fixed random pool, shifted and XOR-ed per chunk so
that no two chunks (and so no two experts) are alike, then the scale fields are overwritten. Where
a field sits is packtools.quants' (the registry); this module says only what values it gets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from ..quants import QUANTS

POOL_BYTES = 64 << 20
TARGET_MAX_ABS = 0.1  # rough largest |weight| the chosen scales produce


@dataclass(frozen=True)
class Scales:
    """How a type's scale parts (packtools.quants names them) are filled; every other byte of a
    block stays random. `f16` parts get a random value in (0.5, 1] x max_scale; the scales are
    chosen so that weights average zero (a negative max_scale for an added minimum)."""

    f16: tuple[tuple[str, float], ...] = ()  # (part, largest scale)
    e8m0: tuple[tuple[str, int], ...] = ()  # (part, exponent byte), MXFP4's shared scale


# The quant types synth writes, with the formula each scale range is chosen for.
SCALES: dict[T, Scales] = {
    T.Q4_0: Scales(f16=(("d", TARGET_MAX_ABS / 8),)),
    T.Q4_1: Scales(f16=(("d", TARGET_MAX_ABS / 15), ("m", -TARGET_MAX_ABS / 2))),
    T.Q5_0: Scales(f16=(("d", TARGET_MAX_ABS / 16),)),
    T.Q5_1: Scales(f16=(("d", TARGET_MAX_ABS / 31), ("m", -TARGET_MAX_ABS / 2))),
    T.Q8_0: Scales(f16=(("d", TARGET_MAX_ABS / 128),)),
    # w = d*sc*q - dmin*m, sc/m 4-bit, q 2-bit
    T.Q2_K: Scales(f16=(("d", TARGET_MAX_ABS / 45), ("dmin", TARGET_MAX_ABS / 30))),
    # w = d*(sc-32)*(q-4)
    T.Q3_K: Scales(f16=(("d", TARGET_MAX_ABS / 128),)),
    # w = d*sc*q - dmin*m, 6-bit sc/m, 4-bit q
    T.Q4_K: Scales(f16=(("d", TARGET_MAX_ABS / 945), ("dmin", TARGET_MAX_ABS / 126))),
    # 5-bit q
    T.Q5_K: Scales(f16=(("d", TARGET_MAX_ABS / 1953), ("dmin", TARGET_MAX_ABS / 126))),
    # w = d*sc*(q-32), sc int8
    T.Q6_K: Scales(f16=(("d", TARGET_MAX_ABS / 4096),)),
    # w = 2^(e-128) * {0,1,2,3,4,6,8,12,...}[q]; e = 121 gives |w| <= 0.094
    T.MXFP4: Scales(e8m0=(("e", 121),)),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED = tuple(SCALES) + FLOAT_TYPES


class RandomFill:
    """Produces random tensor bytes of a given ggml type, chunk by chunk."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        # Every bit uniform: a word drawn below 2**63 would leave every 8th byte non-negative, and
        # that bias in every matrix makes one direction of the hidden state grow layer after layer
        # until the router sends every token to the same experts.
        self.pool = self.rng.integers(0, 2**64, size=POOL_BYTES // 8, dtype=np.uint64)
        self.normal_pool = self.rng.standard_normal(POOL_BYTES // 16, dtype=np.float32)

    def quant(self, ggml_type: T, nbytes: int, gain: float = 1.0) -> np.ndarray:
        """nbytes (a whole number of blocks, at most POOL_BYTES - 8) of valid blocks of ggml_type,
        values up to about gain x TARGET_MAX_ABS."""
        quant, scales = QUANTS[ggml_type], SCALES[ggml_type]
        n_blocks, rem = divmod(nbytes, quant.nbytes)
        assert rem == 0 and nbytes <= POOL_BYTES - 8, (ggml_type, nbytes)
        words = -(-nbytes // 8)
        start = int(self.rng.integers(0, self.pool.size - words))
        mask = self.rng.integers(0, 2**64, dtype=np.uint64)
        data = (self.pool[start:start + words] ^ mask).view(np.uint8)[:nbytes]
        blocks = data.reshape(n_blocks, quant.nbytes)
        for part, max_scale in scales.f16:
            offset = quant.offset(part)
            values = (self.rng.uniform(0.5, 1.0, n_blocks) * max_scale * gain).astype(np.float16)
            blocks[:, offset:offset + 2] = values.view(np.uint8).reshape(n_blocks, 2)
        for part, exponent in scales.e8m0:
            shift = int(round(np.log2(gain)))
            blocks[:, quant.offset(part)] = exponent + shift - self.rng.integers(0, 3, n_blocks, dtype=np.uint8)
        return data

    def floats(self, ggml_type: T, n_values: int, mean: float = 0.0, std: float = 0.02) -> np.ndarray:
        """n_values normal(mean, std) values as F32/F16/BF16 bytes."""
        assert n_values <= self.normal_pool.size
        start = int(self.rng.integers(0, self.normal_pool.size - n_values + 1))
        values = self.normal_pool[start:start + n_values] * np.float32(std * self.rng.uniform(0.8, 1.2)) + np.float32(mean)
        if ggml_type == T.F32:
            return values.view(np.uint8)
        if ggml_type == T.F16:
            return values.astype(np.float16).view(np.uint8)
        if ggml_type == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # truncation: finite in, finite out
        raise ValueError(f"not a float type: {ggml_type.name}")

    def expert_ids(self, n_expert: int, n_used: int, n_tokens: int) -> np.ndarray:
        """[n_tokens, n_used] int32, distinct experts per token: a hash-routing table (tid2eid)."""
        ranks = self.rng.random((n_tokens, n_expert)).argsort(axis=1)[:, :n_used]
        return ranks.astype(np.int32)


def parse_type(name: str) -> T:
    try:
        t = T[name.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}; synth writes {', '.join(x.name for x in SUPPORTED)}") from None
    if t not in SUPPORTED:
        raise ValueError(f"synth cannot write {t.name}; it writes {', '.join(x.name for x in SUPPORTED)}")
    return t
