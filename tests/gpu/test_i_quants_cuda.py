"""The i-quants and ternary quants on CUDA through the fused kernels (skipped without a GPU; run on
the device machine): llama.cpp's real IQ mixes (tests/fixtures/iq) and synthetic models mixed as
the low-bit "dynamic" GGUFs are (IQ1_S gate/up, IQ2_XXS down, a layer at IQ3_XXS; TQ2_0 with
IQ4_XS down) give, on the GPU, the CPU path's logits within float32 summation noise and its
greedy tokens; streamed through expertd into an expert cache of the minimum size they give the
resident run's very bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.packtools.synth.writer import SynthOptions, write_synth
from expertpack.worker.engine.engine import Engine

from ..conftest import IQ_FIXTURES, start_daemon
from ..helpers.engine import assert_same, greedy_run, minimal_cache_bytes

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

MIXES = {"IQ1_S-dynamic": ("IQ1_S", "down=IQ2_XXS,0=IQ3_XXS"), "TQ2_0-IQ4_XS": ("TQ2_0", "down=IQ4_XS")}
PROMPT = [3, 17, 101, 5, 1999, 42, 7, 640]


@pytest.fixture(scope="module", params=sorted(MIXES))
def pack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    expert_type, mix = MIXES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    (src,) = write_synth(root / "model.gguf", SynthOptions(preset="tiny", n_layer=2, expert_type=expert_type,
                                                           expert_mix=mix, progress=False))
    build_pack(src, root / "pack", BuildOptions(progress=False, safety_margin_bytes=0))
    return root / "pack"


def assert_cuda_equals_the_cpu_path(model: Path) -> None:
    cpu_logits, cpu_tokens = greedy_run(Engine.load(model, "cpu", resident_experts=True), PROMPT)
    engine = Engine.load(model, "cuda", resident_experts=True)
    assert engine.place.ops.kernels
    logits, tokens = greedy_run(engine, PROMPT)
    assert tokens == cpu_tokens
    for step, (got, want) in enumerate(zip(logits, cpu_logits)):
        err = (got.cpu() - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), f"step {step}: max |diff| {err:.3g}"


def test_cuda_equals_the_cpu_path(pack: Path) -> None:
    assert_cuda_equals_the_cpu_path(pack)


@pytest.mark.parametrize("name", ["qwen3moe-a.IQ-mix.gguf", "deepseek3-a.IQ-mix.gguf", "mixtral-a.IQ-mix.gguf"])
def test_llama_cpps_iq_files_on_cuda_equal_the_cpu_path(name: str) -> None:
    assert_cuda_equals_the_cpu_path(IQ_FIXTURES / name)


def test_minimal_cache_on_cuda_is_bit_exact(pack: Path, tmp_path: Path) -> None:
    want = greedy_run(Engine.load(pack, "cuda", resident_experts=True), PROMPT)
    d = start_daemon(pack, tmp_path, "--client-slots", "4")
    d.wait_for("READY=1")
    try:
        engine = Engine.load(pack, "cuda", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        try:
            got = greedy_run(engine, PROMPT)
        finally:
            engine.close()
        assert_same(got, want, "minimal cache vs resident")
    finally:
        assert d.stop()[0] == 0
