"""The ggml type registry agrees with gguf-py: every registered type's block (values, and bytes as
the sum of its parts) is GGML_QUANT_SIZES's, its parts have distinct names, and a type not
registered is sized by gguf-py's table."""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from expertpack.packtools.quants import DECODED, QUANTS, block_sizes, nbytes_of


@pytest.mark.parametrize("ggml_type", list(QUANTS), ids=lambda t: t.name)
def test_blocks_are_gguf_py_s(ggml_type: T) -> None:
    quant = QUANTS[ggml_type]
    assert quant.ggml_type is ggml_type
    assert (quant.values, quant.nbytes) == GGML_QUANT_SIZES[ggml_type] == block_sizes(ggml_type)
    names = [p.name for p in quant.parts]
    assert len(set(names)) == len(names)
    assert quant.offset(names[-1]) + quant.parts[-1].nbytes == quant.nbytes


def test_every_type_real_moe_ggufs_use_is_decoded() -> None:
    assert set(DECODED) >= {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K,
                            T.Q5_K, T.Q6_K, T.MXFP4}
    assert T.I32 in QUANTS and T.I32 not in DECODED


def test_offsets_and_unregistered_types() -> None:
    assert QUANTS[T.Q6_K].offset("d") == 208 and QUANTS[T.Q2_K].offset("dmin") == 82
    with pytest.raises(KeyError, match="Q4_0 has no part 'dmin'"):
        QUANTS[T.Q4_0].offset("dmin")
    assert T.NVFP4 not in QUANTS and block_sizes(T.NVFP4) == GGML_QUANT_SIZES[T.NVFP4]
    assert nbytes_of(T.Q4_K, (512, 3)) == 2 * 3 * 144 and nbytes_of(T.NVFP4, (128,)) == 2 * GGML_QUANT_SIZES[T.NVFP4][1]
