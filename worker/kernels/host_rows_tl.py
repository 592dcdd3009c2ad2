"""Rows of a table that lives in pinned host memory, gathered by the GPU over PCIe into VRAM: the
token embedding's lookup. A step reads one row of the embedding a token (a few KB) but the table
is hundreds of MB (Qwen3-30B-A3B's Q8_0 151,936 x 2,048: 0.31 GiB), which in VRAM would take an
expert cache's room; llama.cpp keeps it in host memory too. The GPU reads the rows where they lie,
from inside a CUDA graph, so no host step joins the token's path; the bytes are the table's, so a
row decodes to the same values as from VRAM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # bytes of a row a program copies


@triton.jit
def _host_rows_kernel(out_ptr, ids_ptr, table_at, n_rows, row_bytes, BLOCK: tl.constexpr):
    """Program (r, c): the c-th BLOCK of row ids[r] of the table at out_ptr + table_at (the table's
    address less out's: one pointer reaches both, in CUDA's unified address space) into out's row r.
    An id outside the table is clamped into it: never a read past the table (prompt ids are checked
    against the vocabulary where they enter, serve/api.py)."""
    r = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = o < row_bytes
    i = tl.minimum(tl.maximum(tl.load(ids_ptr + r).to(tl.int64), 0), n_rows - 1)
    row = tl.load(out_ptr + table_at + i * row_bytes + o, mask=inside)
    tl.store(out_ptr + r * row_bytes + o, row, mask=inside)


def host_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [V, row_bytes] uint8 (pinned host memory; on the CPU, under the interpreter, any CPU
    tensor), ids [N] integer on the device that reads it: [N, row_bytes] uint8 on ids' device."""
    assert table.dim() == 2 and table.dtype == torch.uint8 and table.is_contiguous(), table.shape
    n, row_bytes = ids.numel(), table.shape[1]
    out = torch.empty(n, row_bytes, dtype=torch.uint8, device=ids.device)
    if n:
        grid = (n, triton.cdiv(row_bytes, BLOCK))
        _host_rows_kernel[grid](out, ids.reshape(-1).contiguous(), table.data_ptr() - out.data_ptr(), table.shape[0],
                                row_bytes, BLOCK=BLOCK, num_warps=4)
    return out
