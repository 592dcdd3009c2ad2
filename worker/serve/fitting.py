"""--max-batch's default: as many sequences as fit at the model's whole context in the memory the
model and the expert cache left, so that no request runs the KV memory out mid-generation
(sequences hold KV buffers of their own, grown by doubling up to the context: engine/arena.py)."""

from __future__ import annotations

import psutil
import torch

from ..engine.engine import WARM_BATCH, Engine

PASS_BYTES = 512 << 20  # kept free beside the KV memory for a pass's activations (a long prompt's pieces)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can take: the GPU's free memory and what torch's caching
    allocator holds unused; the host's available memory for a CPU device."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def batch_that_fits(per_position: dict[torch.device, int], n_ctx: int, free: dict[torch.device, int],
                    most: int = WARM_BATCH) -> int:
    """Sequences of n_ctx positions whose KV memory fits every device's free memory (less
    PASS_BYTES), at least 1 and at most `most` (the batched steps warm-up captures)."""
    fits = most
    for device, per in per_position.items():
        if per > 0:
            fits = min(fits, int(max(0, free[device] - PASS_BYTES) // (per * n_ctx)))
    return max(1, fits)


def default_max_batch(engine: Engine, n_ctx: int) -> tuple[int, str]:
    """--max-batch where none was given, and the line that says why (for the log)."""
    if not getattr(engine.model, "batched_decode", False):
        return 1, f"{engine.files.arch} runs one sequence a step"
    per = engine.kv_bytes_per_position()
    free = {device: free_bytes(device) for device in per}
    n = batch_that_fits(per, n_ctx, free)
    sizes = ", ".join(f"{d}: {p * n_ctx / 2**30:.2f} GiB a sequence of {n_ctx} positions, "
                      f"{free[d] / 2**30:.1f} GiB free" for d, p in per.items())
    return n, f"what fits ({sizes}; {PASS_BYTES >> 20} MiB kept for activations; at most {WARM_BATCH})"
