"""The decode step a CUDA graph captures, run eagerly: with the KV cache's buffers reserved ahead and
the token's position a device tensor (`step_positions`), a step attends over the whole buffer masked
by position (its sums run over more, masked keys: equal within float32 rounding). For every architecture that declares `static_decode`, such steps give the eager
decode's logits, step after step, and leave the cache where eager decoding leaves it. (tests/gpu
replays the captured graphs themselves.)"""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine import Engine

from ..conftest import FIXTURES

MODELS = {  # one GGUF per architecture that declares static_decode
    "qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",
    "llama": "gguf/mixtral-a/mixtral-a.Q4_K_M.gguf",
    "gpt-oss": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
    "deepseek2": "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf",
    "kimi-k3": "flagship/kimi-k3/k3-tiny.Q2_K.gguf",  # KDA states updated in place
}
PROMPT, FEED = [1, 5, 9, 200], [33, 7, 1000]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_static_steps_equal_eager_decode(arch: str) -> None:
    engine = Engine.load(FIXTURES / MODELS[arch], resident_experts=True)
    assert engine.model.static_decode
    eager = engine.new_cache()
    engine.forward(PROMPT, eager)
    want = torch.cat([engine.forward([t], eager) for t in FEED])

    static = engine.new_cache()
    engine.forward(PROMPT, static)
    static.reserve(300)  # buffers longer than the sequence: the unwritten rows must not count
    position = torch.zeros(1, dtype=torch.int64)
    static.step_positions = position
    got = []
    with torch.inference_mode():
        for t in FEED:
            position.fill_(static.length)
            got.append(engine.model.forward(torch.tensor([t]), static).to(torch.float32))
    static.step_positions = None
    got = torch.cat(got)
    assert static.length == eager.length == len(PROMPT) + len(FEED)
    err = (got - want).abs().max().item()
    assert err < 1e-5, f"{arch}: max |diff| {err:.2e}"
    for layer in eager.keys:  # the same keys in the same rows (the summation order over keys differs)
        torch.testing.assert_close(static.keys[layer][:eager.length], eager.keys[layer][:eager.length],
                                   rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(static.state_tensors(), eager.state_tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_trading_buffers_keeps_each_caches_rows() -> None:
    """A captured step reads fixed buffers: the next request's cache trades buffers with the one in
    them. Both caches keep decoding as if nothing happened."""
    engine = Engine.load(FIXTURES / MODELS["qwen3moe"], resident_experts=True)
    first, second = engine.new_cache(), engine.new_cache()
    engine.forward(PROMPT, first)
    engine.forward(PROMPT[::-1] + [7], second)
    first.reserve(300)
    second.reserve(300)
    assert first.same_shapes(second)
    held = {layer: buffer for layer, buffer in first.keys.items()}
    keys = {layer: buffer.clone() for layer, buffer in first.keys.items()}
    second_keys = {layer: buffer.clone() for layer, buffer in second.keys.items()}
    second.trade_buffers(first)
    for layer in held:
        assert second.keys[layer] is held[layer]  # the buffers a graph would read now hold `second`
        assert torch.equal(second.keys[layer], second_keys[layer]) and torch.equal(first.keys[layer], keys[layer])
    fresh = engine.new_cache()
    engine.forward(PROMPT, fresh)
    assert torch.equal(engine.forward([FEED[0]], first), engine.forward([FEED[0]], fresh))
