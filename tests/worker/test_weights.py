"""Q8_0 trunk matrices regrouped where the kernels run (weights.regroup_q8_0): placing a QTensor
there rewrites its bytes, and every way of reading it (the kernels, torch's dequantization once
the kernels are off, embedding rows, stacks) still gives the GGUF values; placing it elsewhere
gives back the GGUF bytes."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from expertpack.worker.nn.backend import kernels_on_cpu, ops_for
from expertpack.worker.weights.qtensor import QTensor, stacked_rows
from expertpack.worker.weights.quant import dequantize as reference

from ..helpers.quant import random_bytes

pytest.importorskip("triton", reason="regrouping happens where the Triton kernels run")


def q8_0(name: str, k: int, n: int, seed: int) -> tuple[QTensor, torch.Tensor]:
    raw = torch.from_numpy(random_bytes(T.Q8_0, (k, n), seed=seed, valid=True))
    return QTensor(name, T.Q8_0, (k, n), raw), reference(raw, T.Q8_0, (k, n))


def test_q8_0_is_regrouped_where_the_kernels_run_and_reads_as_gguf() -> None:
    t, values = q8_0("w", 512, 9, seed=1)
    assert not t.to("cpu").regrouped  # torch's path reads GGUF bytes
    ids = torch.tensor([[8, 0], [3, 3]])
    with kernels_on_cpu():
        ops = ops_for(torch.device("cpu"))
        placed = t.to("cpu", kernels=ops.kernels)
        assert placed.regrouped and not torch.equal(placed.raw, t.raw)
        assert torch.equal(ops.dequant(placed), values)
        assert torch.equal(ops.rows(placed, ids), values[ids])
        odd, _ = q8_0("odd", 288, 4, seed=2)  # rows of 288 values: chunks would cross rows
        assert not odd.to("cpu", kernels=True).regrouped
    assert torch.equal(placed.dequant(), values) and torch.equal(placed.rows(torch.tensor([5])), values[[5]])
    back = placed.to("cpu")
    assert not back.regrouped and torch.equal(back.raw, t.raw)


def test_regrouped_matrices_stack_only_with_their_kind() -> None:
    a, va = q8_0("a", 256, 3, seed=3)
    b, vb = q8_0("b", 256, 5, seed=4)
    with kernels_on_cpu():
        ops = ops_for(torch.device("cpu"))
        ra, rb = a.to("cpu", kernels=True), b.to("cpu", kernels=True)
        stacked = stacked_rows("ab", [ra, rb])
        assert stacked is not None and stacked.regrouped
        assert torch.equal(ops.dequant(stacked), torch.cat([va, vb]))
    assert stacked_rows("mixed", [ra, b]) is None
