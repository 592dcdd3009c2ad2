"""Dequantization equals gguf-py's reference bit for bit (float32 bits compared, so signed zeros and
NaN payloads count too), for every supported type, on valid random blocks and on raw random bytes,
for many shapes (the i-quants' and ternary quants' valid blocks: random codes, finite f16 scales);
a tensor of every decoded type passes the load-time check; unsupported types are refused by name.

One inherent difference, only on raw bytes: where a float16 scale is NaN or infinite (an invalid
block no quantizer writes), the result is NaN in both, but NaN payloads are not portable: torch's
half->float conversion quiets signaling NaNs and its vector kernels produce their default NaN for
inf*0, where numpy propagates the payload. There the test requires NaN in both; every other value
must match bit for bit, and valid blocks (no NaN anywhere) must match bit for bit everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from expertpack.packtools.quants import DECODED
from expertpack.worker.weights.qtensor import QTensor
from expertpack.worker.weights.quant import Q8_0_REGROUPED, UnsupportedType, check_supported, dequantize

from ..helpers.gguf_float import I_QUANTS
from ..helpers.quant import SHAPES, random_bytes, reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference on NaN scales


@pytest.mark.parametrize("ggml_type", DECODED, ids=lambda t: t.name)
@pytest.mark.parametrize("valid", [True, False], ids=["valid", "raw-bytes"])
def test_bit_equal_to_gguf_py(ggml_type: T, valid: bool) -> None:
    for i, shape in enumerate(SHAPES):
        block_values = GGML_QUANT_SIZES[ggml_type][0]
        if shape[0] % block_values:
            continue
        raw = random_bytes(ggml_type, shape, seed=i, valid=valid)
        want = reference(raw, ggml_type, shape)
        got = dequantize(torch.from_numpy(raw), ggml_type, shape).numpy()
        assert got.shape == want.shape and got.dtype == np.float32
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        if valid:
            assert not np.isnan(want).any()
        if not same.all():
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            raise AssertionError(f"{ggml_type.name} {shape}: {int((~same).sum())} values differ, "
                                 f"max {np.nanmax(diff):.3g}, mean {np.nanmean(diff):.3g}")


def test_the_kernels_own_type_id_is_no_ggml_type() -> None:
    assert Q8_0_REGROUPED not in {int(t) for t in T}


I_QUANT_LIST = sorted(I_QUANTS, key=lambda t: t.name)


def test_every_i_quant_and_ternary_quant_is_decoded() -> None:
    assert I_QUANTS <= set(DECODED)


@pytest.mark.parametrize("ggml_type", I_QUANT_LIST, ids=lambda t: t.name)
def test_an_i_quant_tensor_loads_and_reads_as_gguf_py(ggml_type: T) -> None:
    """What a model's loader makes of an IQ tensor (a QTensor: check_supported at construction)
    reads as gguf-py's values, whole and by rows (an embedding lookup)."""
    shape = (512, 6)
    raw = random_bytes(ggml_type, shape, seed=7, valid=True)
    check_supported(ggml_type, "blk.0.ffn_down_exps.weight")
    w = QTensor("blk.0.ffn_down_exps.weight", ggml_type, shape, torch.from_numpy(raw))
    want = torch.from_numpy(reference(raw, ggml_type, shape))
    assert torch.equal(w.dequant(), want)
    ids = torch.tensor([[5, 0], [2, 2]])
    assert torch.equal(w.rows(ids), want[ids])


def test_unsupported_type_is_named_with_its_tensor() -> None:
    with pytest.raises(UnsupportedType, match="NVFP4 in tensor blk.3.ffn_down_exps.weight"):
        check_supported(T.NVFP4, "blk.3.ffn_down_exps.weight")
