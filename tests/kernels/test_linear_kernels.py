"""The decoding kernels against worker/weights/quant.py (itself bit-equal to gguf-py): every type's whole-
matrix dequantization, and the fused matvec against x @ W^T of the reference values, on valid random
blocks of several shapes, including rows that end inside a 256-value chunk; and TritonOps' ops on an
i-quant (whose decoders read their grids through a table pointer) against TorchOps'."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from expertpack.worker.kernels.linear_tl import dequantize, matvec
from expertpack.packtools.quants import DECODED
from expertpack.worker.nn.backend import ops_for
from expertpack.worker.nn.ops import TorchOps
from expertpack.worker.weights.qtensor import QTensor
from expertpack.worker.weights.quant import dequantize as reference

from ..helpers.engine import kernels_for
from ..helpers.quant import random_bytes

# (K, N): K a multiple of 256 for the K-quants, of 32 only for the others (a row ends mid-chunk).
SHAPES_K = [(256, 3), (512, 17)]
SHAPES_32 = [(96, 5), (2880 // 10, 33)]
SHAPES_F = [(40, 3), (300, 19)]


def shapes_for(ggml_type: T) -> list[tuple[int, int]]:
    block_values = GGML_QUANT_SIZES[ggml_type][0]
    return SHAPES_K if block_values == 256 else SHAPES_32 if block_values == 32 else SHAPES_F + SHAPES_K


@pytest.mark.parametrize("ggml_type", DECODED, ids=lambda t: t.name)
def test_dequantize_equals_reference(ggml_type: T, device: torch.device) -> None:
    for i, (k, n) in enumerate(shapes_for(ggml_type)):
        raw = torch.from_numpy(random_bytes(ggml_type, (k, n), seed=10 + i, valid=True))
        want = reference(raw, ggml_type, (k, n))  # [N, K]
        got = dequantize(raw.to(device), int(ggml_type), k, n).cpu()
        # The interpreter does numpy's arithmetic: exact. CUDA may contract d*q - m into one FMA.
        tol = 0 if device.type == "cpu" else 1e-6
        err = (got - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), f"{ggml_type.name} {k}x{n}: max |diff| {err}"


@pytest.mark.parametrize("ggml_type", DECODED, ids=lambda t: t.name)
@pytest.mark.parametrize("t", [1, 3])
def test_matvec_equals_dense_product(ggml_type: T, t: int, device: torch.device) -> None:
    for i, (k, n) in enumerate(shapes_for(ggml_type)):
        raw = torch.from_numpy(random_bytes(ggml_type, (k, n), seed=20 + i, valid=True))
        w = reference(raw, ggml_type, (k, n)).double()
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(i))
        want = x.double() @ w.T
        got = matvec(x.to(device), raw.to(device), int(ggml_type), k, n).cpu().double()
        rel = ((got - want).norm() / want.norm()).item()
        assert got.shape == (t, n) and rel < 1e-6, f"{ggml_type.name} {k}x{n}: relative error {rel:.2e}"


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ1_M, T.IQ4_NL, T.TQ1_0], ids=lambda t: t.name)
def test_ops_on_an_i_quant_run_the_kernels(ggml_type: T, device: torch.device) -> None:
    """TritonOps' quantized-matrix ops on an i-quant: the values (dequant, an embedding's rows) are
    TorchOps' bit for bit where the interpreter runs them (CUDA may contract into FMAs), the
    products within float32 summation noise of theirs."""
    k, n, h = 512, 6, 2
    raw = torch.from_numpy(random_bytes(ggml_type, (k, n), seed=3, valid=True)).to(device)
    w = QTensor("w", ggml_type, (k, n), raw)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)).to(device)
    ids = torch.tensor([[5, 0], [2, 2]], device=device)
    heads = torch.randn(1, h, k // h, generator=torch.Generator().manual_seed(4)).to(device)
    w_heads = QTensor("w_heads", ggml_type, (k // h, n, h), raw)
    torch_ops = TorchOps(device)
    with kernels_for(device):
        ops = ops_for(device)
        assert ops.kernels
        values = (ops.dequant(w), ops.rows(w, ids))
        parts = ops.linear_parts(x, w)  # [T, S, out]: the splits of K, summed by its consumers
        products = (ops.linear(x, w), parts.sum(1) if parts.dim() == 3 else parts, ops.head_linear(heads, w_heads))
    tol = 0 if device.type == "cpu" else 1e-6
    for name, a, b in zip(("dequant", "rows"), values, (torch_ops.dequant(w), torch_ops.rows(w, ids))):
        assert (a - b).abs().max().item() <= tol * b.abs().max().item(), f"{ggml_type.name} {name}"
    want = (torch_ops.linear(x, w), torch_ops.linear(x, w), torch_ops.head_linear(heads, w_heads))
    for name, a, b in zip(("linear", "linear_parts", "head_linear"), products, want):
        assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < 1e-5, f"{ggml_type.name} {name}"


def test_mxfp4_extreme_exponents_as_the_reference(device: torch.device) -> None:
    """E8M0 exponents at both ends (subnormal scales at 0 and 1, 2^127 at 255, where a scale of
    2^(e - 127) would overflow and turn a zero nibble into NaN), every nibble, through the decoders
    of dequantize and of the matvec."""
    k, n = 64, 4
    raw = torch.zeros(n, k // 32, 17, dtype=torch.uint8)
    raw[:, :, 0] = torch.tensor([[0, 1], [127, 128], [254, 255], [255, 126]], dtype=torch.uint8)
    raw[:, :, 1:] = torch.arange(16, dtype=torch.uint8) * 17  # bytes 0x00, 0x11, .., 0xFF: each nibble value
    raw = raw.flatten()
    want = reference(raw, T.MXFP4, (k, n))
    got = dequantize(raw.to(device), int(T.MXFP4), k, n).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = torch.zeros(1, k)
    x[0, 3] = 1.0  # one value of the first block of each row: (low nibble 3) its value, finite or inf
    y = matvec(x.to(device), raw.to(device), int(T.MXFP4), k, n).cpu()
    torch.testing.assert_close(y, want[:, 3][None, :], rtol=0, atol=0)


def test_regrouped_q8_0_decodes_as_the_gguf_bytes(device: torch.device) -> None:
    """Q8_0 rows regrouped for the decode kernel (weights.regroup_q8_0: a chunk's scales, then its
    quants) give the reference values through every kernel that reads them: whole-matrix
    dequantization, the matvec (one row of x and several, short matrices split along K, every
    chunk of the 8,192-value rows), and one matrix per head; and regrouping is undone exactly."""
    from expertpack.worker.kernels.linear_tl import matvec_heads
    from expertpack.worker.weights.quant import Q8_0_REGROUPED
    from expertpack.worker.weights.qtensor import regroup_q8_0, ungroup_q8_0

    for i, (k, n) in enumerate([(256, 3), (512, 37), (1792, 100), (8192, 5)]):  # 1792: a spare split-K chunk
        raw = torch.from_numpy(random_bytes(T.Q8_0, (k, n), seed=30 + i, valid=True))
        regrouped = regroup_q8_0(raw)
        assert torch.equal(ungroup_q8_0(regrouped), raw) and not torch.equal(regrouped, raw)
        w = reference(raw, T.Q8_0, (k, n))
        got = dequantize(regrouped.to(device), Q8_0_REGROUPED, k, n).cpu()
        assert (got - w).abs().max().item() <= (0 if device.type == "cpu" else 1e-6) * w.abs().max().item()
        for t in (1, 3):
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(i))
            want = x.double() @ w.double().T
            y = matvec(x.to(device), regrouped.to(device), Q8_0_REGROUPED, k, n).cpu()
            rel = ((y.double() - want).norm() / want.norm()).item()
            assert y.shape == (t, n) and rel < 1e-6, f"{k}x{n}, {t} rows: relative error {rel:.2e}"
            alone = [matvec(x[j:j + 1].to(device), regrouped.to(device), Q8_0_REGROUPED, k, n).cpu() for j in range(t)]
            assert torch.equal(y, torch.cat(alone)), f"{k}x{n}: a row's bits depend on the rows beside it"
    k, r, h = 256, 6, 4
    raw = torch.from_numpy(random_bytes(T.Q8_0, (k, r * h), seed=40, valid=True))
    x = torch.randn(2, h, k, generator=torch.Generator().manual_seed(5))
    want = torch.einsum("thk,hrk->thr", x.double(), reference(raw, T.Q8_0, (k, r * h)).double().view(h, r, k))
    got = matvec_heads(x.to(device), regroup_q8_0(raw).to(device), Q8_0_REGROUPED, k, r).cpu().double()
    assert ((got - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.MXFP4, T.IQ2_XXS, T.F16],
                         ids=lambda t: t.name)
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(ggml_type: T, device: torch.device) -> None:
    """A batched decode step's rows go through the trunk's matvec together: each row's sums are
    its own, so in a batch of five every row is its own run's, bit for bit. A kernel that shares
    the weights' reads across rows must keep this (a form that took 8 rows a program kept it and
    gained nothing on the H100, where the trunk is regrouped Q8_0; the regrouped kernel's did not)."""
    k, n = shapes_for(ggml_type)[-1]
    raw = torch.from_numpy(random_bytes(ggml_type, (k, n), seed=50, valid=True)).to(device)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).to(device)
    together = matvec(x, raw, int(ggml_type), k, n)
    for i in range(5):
        alone = matvec(x[i:i + 1].contiguous(), raw, int(ggml_type), k, n)
        assert torch.equal(together[i], alone[0]), f"{ggml_type.name} row {i}"
