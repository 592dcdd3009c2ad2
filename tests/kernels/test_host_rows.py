"""The token embedding's rows read by the GPU from pinned host memory (kernels/host_rows_tl.py):
the table's bytes, row for row, whatever the row length against the kernel's block; ids outside
the table clamped into it; and through TritonOps.rows, a table on the host decodes to the values
QTensor.rows gives."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from expertpack.worker.kernels.host_rows_tl import host_rows
from expertpack.worker.nn.backend import ops_for
from expertpack.worker.weights.qtensor import QTensor

from ..helpers.engine import kernels_for


def on_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where the GPU reads the table in place: pinned host memory (a plain CPU tensor under the interpreter)."""
    return t.pin_memory() if device.type == "cuda" else t


@pytest.mark.parametrize("row_bytes", [34, 1024, 2176, 3000])
def test_rows_are_the_tables_bytes(row_bytes: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(row_bytes)
    table = torch.randint(0, 256, (50, row_bytes), dtype=torch.uint8, generator=g)
    ids = torch.tensor([7, 0, 49, 7, 23])
    got = host_rows(on_host(table, device), ids.to(device))
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), table[ids])


def test_ids_outside_the_table_are_clamped_into_it(device: torch.device) -> None:
    table = torch.arange(8 * 40, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 40)
    got = host_rows(on_host(table, device), torch.tensor([-3, 8, 1000], device=device)).cpu()
    assert torch.equal(got, table[[0, 7, 7]])
    assert host_rows(on_host(table, device), torch.empty(0, dtype=torch.int64, device=device)).shape == (0, 40)


def test_a_pinned_table_decodes_as_one_on_the_device(device: torch.device) -> None:
    """Q8_0 rows of 256 values, regrouped for the kernels as Placement places them, from the host."""
    g = torch.Generator().manual_seed(3)
    n_vocab, d = 40, 256
    blocks = torch.randint(0, 256, (n_vocab * d // 32, 34), dtype=torch.uint8, generator=g)
    blocks[:, :2] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # every scale float16 1.0: no NaN or inf
    embd = QTensor("token_embd.weight", T.Q8_0, (d, n_vocab), blocks.reshape(-1))
    ids = torch.tensor([[3, 39, 0]])
    want = embd.rows(ids)
    with kernels_for(device):
        ops = ops_for(device)
        table = embd.to(device, ops.kernels)
        if device.type == "cuda":
            table = embd.pinned(ops.kernels)
            assert table.raw.is_pinned() and table.regrouped
        got = ops.rows(table, ids.to(device)).cpu()
    assert torch.equal(got, want)
