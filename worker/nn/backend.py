"""Which ops a device runs, decided once as a model loads onto it (Placement.ops): the Triton
kernels on CUDA, torch elsewhere, and the kernels on the CPU for tests (kernels_on_cpu)."""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from .ops import TorchOps

_kernels_on_cpu = False


def ops_for(device: torch.device) -> TorchOps:
    """The ops `device` runs: the Triton kernels on CUDA (and on the CPU inside kernels_on_cpu, for
    tests), torch elsewhere. Called once per device as a model loads."""
    if device.type == "cuda" or (device.type == "cpu" and _kernels_on_cpu):
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(f"device {device}: the GPU path runs Triton kernels, and triton is not installed "
                               f"(it comes with torch's CUDA builds; pip install triton)")
        # The kernels' one import, here at load: Triton defines them as it imports them, and on the
        # CPU must see kernels_on_cpu's TRITON_INTERPRET first.
        from .triton_ops import TritonOps

        return TritonOps(device)
    return TorchOps(device)


@contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Models loaded inside run the fast path on the CPU through Triton's interpreter, which is how
    CI checks the kernels' wiring without a GPU. Triton must see TRITON_INTERPRET=1 when the
    kernels are defined and while they run (it imports parts of itself lazily): load and run
    inside."""
    global _kernels_on_cpu
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _kernels_on_cpu = True
    try:
        yield
    finally:
        _kernels_on_cpu = False
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
