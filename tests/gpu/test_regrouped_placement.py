"""Q8_0 trunk matrices placed on CUDA (skipped without a GPU; run on the device machine): regrouped
there for the decode kernel, with the same values as the GGUF bytes, and no memory left reserved by
the regrouping's temporaries, which an expert cache sizing itself from the free memory would lose."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from expertpack.worker.nn.placement import Placement
from expertpack.worker.weights.qtensor import QTensor
from expertpack.worker.weights.quant import dequantize

from ..helpers.quant import random_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_placed_q8_0_is_regrouped_and_leaves_nothing_reserved() -> None:
    k, n = 4096, 8192  # 35.7 MB of Q8_0, as an attention projection of DeepSeek-V4-Flash
    raw = torch.from_numpy(random_bytes(T.Q8_0, (k, n), seed=7, valid=True))
    cuda = torch.device("cuda")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(cuda)
    placed = Placement.single(cuda).weights({"blk.0.attn_q_b.weight": QTensor("blk.0.attn_q_b.weight", T.Q8_0,
                                                                              (k, n), raw)})
    w = placed["blk.0.attn_q_b.weight"]
    assert w.regrouped and w.raw.is_cuda
    # What stays reserved is the matrix itself (the allocator rounds it up), not its temporaries.
    assert torch.cuda.memory_reserved(cuda) - before < 1.1 * raw.numel()
    assert torch.equal(w.dequant()[:64].cpu(), dequantize(raw, T.Q8_0, (k, n))[:64])
