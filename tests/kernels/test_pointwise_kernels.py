"""RMSNorm, rotary embeddings and the hyper-connection weights in one launch each, against the torch
formulas (both RoPE layouts, partial rotation, with and without a norm weight, row widths that are not
powers of two)."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.kernels.hyper_tl import hc_weights
from expertpack.worker.kernels.pointwise_tl import rms_norm, rope
from expertpack.worker.nn.hyper_connections import HyperConnection
from expertpack.worker.nn.layers import Rope, RopeStyle, rms_norm as torch_rms_norm
from expertpack.worker.nn.backend import ops_for
from expertpack.worker.nn.ops import TorchOps

from ..helpers.engine import kernels_for

TORCH = TorchOps(torch.device("cpu"))


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


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_on_the_last_channels(style: RopeStyle, inverse: bool, device: torch.device) -> None:
    """DeepSeek-V4 rotates the last channels of a head (and undoes it on the output): in place of a
    copy of the tail, its rotation and a cat."""
    r = Rope(16, 10000.0, style)
    g = torch.Generator().manual_seed(int(inverse))
    x = torch.randn(3, 5, 40, generator=g)
    cos, sin = r.cos_sin(torch.arange(7, 10), torch.device("cpu"))
    want = torch.cat([x[..., :-16], r.apply(x[..., -16:], cos, -sin if inverse else sin)], dim=-1)
    got = rope(x.to(device), cos.to(device), sin.to(device), 16, style is RopeStyle.NEOX, start=24,
               inverse=inverse).cpu()
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
    want = hc.weights(TORCH, streams)  # the torch path (CPU)
    got = hc_weights(hc._mixes(TORCH, streams).to(device), hc.base.to(device), hc.scale.to(device), n, 20, 1e-6)
    for name, w, x in zip(("pre", "post", "comb"), want, got):
        torch.testing.assert_close(x.cpu(), w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert torch.allclose(got[2].sum(dim=-2).cpu(), torch.ones(t, n), atol=1e-4)  # columns: doubly stochastic


@pytest.mark.parametrize("n,d", [(4, 96), (3, 80)])
def test_hyper_connection_collapse_and_expand(n: int, d: int, device: torch.device) -> None:
    """The streams collapsed into a block's normalized input, and the block's output spread back
    over them, one launch each through the ops' seam (TritonOps), against the torch formulas (TorchOps)."""
    g = torch.Generator().manual_seed(n * d)
    t = 3
    streams, out = torch.randn(t, n, d, generator=g), torch.randn(t, d, generator=g)
    pre, post, comb = torch.rand(t, n, generator=g), torch.rand(t, n, generator=g), torch.rand(t, n, n, generator=g)
    weight = torch.randn(d, generator=g)
    hc = HyperConnection(torch.zeros(1), torch.zeros(1), torch.zeros(1), n, 1, 1e-6, norm_eps=1e-6)
    want = hc.block_input(TORCH, streams, pre, weight), TORCH.hc_expand(streams, out, post, comb)
    with kernels_for(device):  # the kernels: on the CPU through the interpreter, else on `device`
        ops = ops_for(device)
        streams, out, pre, post, comb, weight = (v.to(device) for v in (streams, out, pre, post, comb, weight))
        got = hc.block_input(ops, streams, pre, weight), ops.hc_expand(streams, out, post, comb)
    for name, a, b in zip(("block input", "expanded streams"), got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
