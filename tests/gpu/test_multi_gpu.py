"""A worker spanning two GPUs (issue 16; skipped where fewer than two CUDA devices are visible; run
on the device machine's nvidia-h200-x2): the layers split over cuda:0 and cuda:1 give the logits of
cuda:0 alone bit for bit (the single GPU decodes through its CUDA graph, the split eagerly: the same
static-shape step), with every expert resident and through expertd into one expert cache per GPU
sharing one connection and one staging registration (portable: pinned for both GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.worker.engine.engine import Engine
from expertpack.worker.experts.split_experts import CacheGroup

from ..conftest import FIXTURES, start_daemon
from ..helpers.engine import greedy_run, minimal_cache_bytes

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

MODELS = ["gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf", "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
          "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", "flagship/kimi-k3/k3-tiny.Q2_K.gguf",
          "flagship/deepseek4/dsv4-tiny.BF16.gguf"]  # qwen3moe's fused norms, MLA, KDA states, hyper-connections
PROMPT = [1, 5, 9, 200, 17, 3, 44, 12]


def on_host(run: tuple[list[torch.Tensor], list[int]]) -> tuple[list[torch.Tensor], list[int]]:
    logits, tokens = run
    return [t.cpu() for t in logits], tokens


def assert_same(got, want, what: str) -> None:
    assert got[1] == want[1], f"{what}: greedy tokens differ"
    for step, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(g, w), f"{what}: step {step}: max |diff| {(g - w).abs().max().item():.2e}"


@pytest.mark.parametrize("path", MODELS)
def test_two_gpus_give_one_gpus_logits(path: str) -> None:
    if not (FIXTURES / path).exists():
        pytest.skip(f"{path} is not among the fixtures carried here")
    want = on_host(greedy_run(Engine.load(FIXTURES / path, "cuda:0", resident_experts=True), PROMPT, 6))
    engine = Engine.load(FIXTURES / path, "cuda:0,cuda:1", resident_experts=True)
    first, second = engine.layer_ranges
    assert engine.place.devices == (torch.device("cuda", 0), torch.device("cuda", 1)) and len(first) and len(second)
    assert engine.model.w[f"blk.{second.start}.attn_norm.weight"].raw.device == torch.device("cuda", 1)
    assert engine.model.w["token_embd.weight"].raw.is_pinned()  # in host memory, read by the first GPU
    logits, tokens = greedy_run(engine, PROMPT, 6)
    assert logits[-1].device == torch.device("cuda", 1)  # the head runs on the last GPU
    assert engine._graphs.get(0) is None  # a split decodes eagerly
    assert_same(on_host((logits, tokens)), want, f"{path} over two GPUs")
    engine.close()


def test_two_gpus_through_expertd_share_one_connection(tmp_path: Path) -> None:
    src = FIXTURES / "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf"
    pack = tmp_path / "pack"
    build_pack(src, pack, BuildOptions(progress=False, safety_margin_bytes=0))
    d = start_daemon(pack, tmp_path, "--client-slots", "4")
    d.wait_for("READY=1")
    try:
        want = on_host(greedy_run(Engine.load(pack, "cuda:0", resident_experts=True), PROMPT))
        engine = Engine.load(pack, "cuda:0,cuda:1", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            group = engine.expert_cache
            assert isinstance(group, CacheGroup) and [c.device.index for c in group.caches] == [0, 1]
            assert all(c.memory.device == c.device for c in group.caches)
            assert group.link.pinned and group.link.staging.is_pinned()  # registered once, for both GPUs
            got = on_host(greedy_run(engine, PROMPT))
            stats = group.stats()
            print(f"two GPUs through expertd: {stats['cache']}; per device {stats['devices']}")
            assert all(dev["misses"] > 0 for dev in stats["devices"])
        finally:
            engine.close()
        assert_same(got, want, "qwen3moe through expertd over two GPUs")
    finally:
        assert d.stop()[0] == 0
