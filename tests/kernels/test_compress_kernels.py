"""DeepSeek-V4's compressor step in two launches (kernels/compress_tl.py) against the torch formulas
of compressed_attention._compress_step, token after token through several windows: CSA's overlapping
pools (the first window without an overlap: its half weighs nothing), HCA's single series, entry
widths that are not powers of two; every buffer compared after every token."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.kernels.compress_tl import compress_step, step_visible
from expertpack.worker.nn import compressed_attention as ca
from expertpack.worker.nn.layers import Rope, RopeStyle
from expertpack.worker.nn.ops import TorchOps

TORCH = TorchOps(torch.device("cpu"))  # the torch formulas, the reference


# Entry widths that are not powers of two: the entry kernel once read past the pooled row there
# (values never stored), which the interpreter reports as overflows in the discarded lanes.
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("ratio,d,overlap", [(4, 24, True), (8, 40, False), (128, 16, False)])
def test_compress_step_equals_the_torch_step(ratio: int, d: int, overlap: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(ratio + d)
    width, capacity, rot = (2 if overlap else 1) * d, 3 * ratio + 2, 8
    rope = Rope(rot, 160000.0, RopeStyle.NORM, factor=4.0, original_context=64)
    ape, norm = torch.randn(ratio, width, generator=g), torch.randn(d, generator=g)
    want = ca.CompressorBuffers.empty(width, d, ratio, capacity, torch.device("cpu"))
    got = ca.CompressorBuffers.empty(width, d, ratio, capacity, device)
    for pos in range(capacity - 1):  # three windows complete and a fourth begins
        kv, gate = torch.randn(1, width, generator=g) * 2, torch.randn(1, width, generator=g) * 3
        position = torch.tensor([pos])
        ca._compress_step(TORCH, want, kv, gate, ape, norm, ratio, position, rope, 1e-6, capacity)  # the torch path (CPU)
        compress_step(got.kv, got.gate, got.overlap, got.entries, kv.to(device), gate.to(device), ape.to(device),
                      norm.to(device), 1e-6, position.to(device), *rope.table(device, capacity), rot)
        for name, a, b in zip(("kv", "gate", "entries", "overlap kv", "overlap gate"), got.tensors(), want.tensors()):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} at {pos}: {m}")
    assert want.entries[:3].abs().sum(dim=1).min() > 0 and not want.entries[3:].any()  # three entries, no more


@pytest.mark.parametrize("size,n_entries,ratio", [(127, 128, 4), (127, 4, 128), (31, 0, 0), (5, 1500, 4)])
def test_step_visible_equals_the_torch_mask(size: int, n_entries: int, ratio: int, device: torch.device) -> None:
    """The keys a decode token sees (the raw ring, itself, the complete windows' entries) in one
    launch, against compressed_attention._visible's torch formula, before, around and past the
    ring's first turn and the windows' ends."""
    for pos in sorted({0, 1, 3, 4, size - 1, size, size + 1, 129, 600, 5 * 1500 - 1}):
        want = ca._visible(TORCH, torch.tensor([pos]), size, n_entries, ratio, size + 1)  # the torch path (CPU)
        got = step_visible(torch.tensor([pos], device=device), size, n_entries, ratio).cpu()
        assert torch.equal(got, want), f"position {pos}"
