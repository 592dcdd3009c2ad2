"""RMSNorm, rotary embeddings and the hyper-connection weights in one launch each, against the torch
formulas (both RoPE layouts, partial rotation, with and without a norm weight, row widths that are not
powers of two)."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.hyper_connections import HyperConnection
from expertpack.worker.kernels.hyper_tl import hc_weights
from expertpack.worker.kernels.pointwise_tl import rms_norm, rope
from expertpack.worker.layers import Rope, RopeStyle, rms_norm as torch_rms_norm


@pytest.mark.parametrize("d", [64, 96, 2880])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(d: int, weighted: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, 3, d, generator=g) * 3
    w = torch.randn(d, generator=g) if weighted else None
    want = torch_rms_norm(x, w, 1e-6)
    got = rms_norm(x.to(device), None if w is None else w.to(device), 1e-6).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (192, 64), (80, 80)])
def test_rope(style: RopeStyle, head_dim: int, rot: int, device: torch.device) -> None:
    r = Rope(rot, 10000.0, style, factor=4.0, original_context=64, mscale=1.2)
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(6, 4, head_dim, generator=g)
    cos, sin = r.cos_sin(torch.arange(30, 36), torch.device("cpu"))
    want = r.apply(x, cos, sin)  # the torch path (CPU)
    got = rope(x.to(device), cos.to(device), sin.to(device), rot, style is RopeStyle.NEOX).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [4, 3])
def test_hyper_connection_weights(n: int, device: torch.device) -> None:
    """The Sinkhorn-normalized hyper-connection weights in one launch, against the torch formulas
    (n = 3: a stream count that is not a power of two)."""
    g = torch.Generator().manual_seed(n)
    d, t = 8, 5
    hc = HyperConnection(torch.randn((2 + n) * n, n * d, generator=g), torch.randn((2 + n) * n, generator=g),
                         torch.rand(3, generator=g) + 0.5, n, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    streams = torch.randn(t, n, d, generator=g)
    want = hc.weights(streams)  # the torch path (CPU)
    got = hc_weights(hc._mixes(streams).to(device), hc.base.to(device), hc.scale.to(device), n, 20, 1e-6)
    for name, w, x in zip(("pre", "post", "comb"), want, got):
        torch.testing.assert_close(x.cpu(), w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert torch.allclose(got[2].sum(dim=-2).cpu(), torch.ones(t, n), atol=1e-4)  # columns: doubly stochastic
