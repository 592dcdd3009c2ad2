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
    chosen so that weights average zero (a negative max_scale for an added minimum). `signed`
    gives each block's f16 scale a random sign: the i-quants' tables and TQ2_0's codes are not
    centred on zero (IQ4_NL's run -127..113), so a fixed sign would bias every matrix."""

    f16: tuple[tuple[str, float], ...] = ()  # (part, largest scale)
    e8m0: tuple[tuple[str, int], ...] = ()  # (part, exponent byte), MXFP4's shared scale
    f16_nibbles: tuple[tuple[str, float], ...] = ()  # IQ1_M: an f16 in the top nibbles of 4 uint16
    signed: bool = False


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
    # The i-quants: w = d x (a 4-bit block scale's factor) x grid value x sign; any grid index and
    # sign bit is valid. IQ2_*: (0.5+15)/4 x 43
    T.IQ2_XXS: Scales(f16=(("d", TARGET_MAX_ABS / 167),), signed=True),
    T.IQ2_XS: Scales(f16=(("d", TARGET_MAX_ABS / 167),), signed=True),
    T.IQ2_S: Scales(f16=(("d", TARGET_MAX_ABS / 167),), signed=True),
    # (0.5+15)/2 x 62; IQ3_S: (1+2*15) x 15
    T.IQ3_XXS: Scales(f16=(("d", TARGET_MAX_ABS / 481),), signed=True),
    T.IQ3_S: Scales(f16=(("d", TARGET_MAX_ABS / 465),), signed=True),
    # (2*7+1) x (1 + delta 0.125)
    T.IQ1_S: Scales(f16=(("d", TARGET_MAX_ABS / 17),), signed=True),
    T.IQ1_M: Scales(f16_nibbles=(("scales", TARGET_MAX_ABS / 17),), signed=True),
    # w = d x kvalues[q], |kvalues| <= 127; IQ4_XS: d x (6-bit scale - 32) x kvalues[q]
    T.IQ4_NL: Scales(f16=(("d", TARGET_MAX_ABS / 127),), signed=True),
    T.IQ4_XS: Scales(f16=(("d", TARGET_MAX_ABS / 4064),), signed=True),
    # w = d x (trit - 1); TQ2_0: d x (q - 1), q in 0..3
    T.TQ1_0: Scales(f16=(("d", TARGET_MAX_ABS),), signed=True),
    T.TQ2_0: Scales(f16=(("d", TARGET_MAX_ABS / 2),), signed=True),
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
            values = self._f16_scales(n_blocks, max_scale * gain, scales.signed)
            blocks[:, offset:offset + 2] = values.view(np.uint8).reshape(n_blocks, 2)
        for part, max_scale in scales.f16_nibbles:
            offset = quant.offset(part)
            d_bits = self._f16_scales(n_blocks, max_scale * gain, scales.signed).view(np.uint16)
            words = blocks[:, offset:offset + 8].copy().view(np.uint16)  # [n_blocks, 4], little-endian
            for i in range(4):  # nibble i of the f16 is the top nibble of word i
                words[:, i] = (words[:, i] & 0x0FFF) | (((d_bits >> (4 * i)) & 0xF) << 12)
            blocks[:, offset:offset + 8] = words.view(np.uint8)
        for part, exponent in scales.e8m0:
            shift = int(round(np.log2(gain)))
            blocks[:, quant.offset(part)] = exponent + shift - self.rng.integers(0, 3, n_blocks, dtype=np.uint8)
        return data

    def _f16_scales(self, n_blocks: int, max_scale: float, signed: bool) -> np.ndarray:
        """n_blocks scales in (0.5, 1] x max_scale as float16, of random sign where `signed`."""
        values = self.rng.uniform(0.5, 1.0, n_blocks) * max_scale
        if signed:
            values *= self.rng.choice(np.array([-1.0, 1.0]), n_blocks)
        return values.astype(np.float16)

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
