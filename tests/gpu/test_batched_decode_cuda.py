"""Batched decode steps on CUDA (skipped without a GPU; run on the device machine): the scenario of
tests/helpers/batched.py (sequences joining after their prefill and leaving, a slot
reused) through the kernels on the GPU, on the fixtures' GQA models and a 2-layer Qwen3-30B-A3B
synth (real shapes: gate/up's K split by the step's pairs). Each sequence's greedy tokens equal its
run alone; its logits stay within float32 rounding of its own eager steps (printed: the largest
difference, 0 where the rows came out bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertpack.packtools.synth.writer import SynthOptions, write_synth
from expertpack.worker.engine.engine import Engine

from ..conftest import FIXTURES
from ..helpers.batched import MODELS, SCENARIOS, alone, batched

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (path,) = write_synth(tmp_path_factory.mktemp("q3") / "model.gguf",
                          SynthOptions(preset="qwen3-30b-a3b", n_layer=2, progress=False))
    return path


@pytest.mark.parametrize("model", sorted(MODELS) + ["qwen3-30b-a3b-2L"])
def test_batched_steps_on_cuda_give_each_sequence_its_own_tokens(model: str, synth: Path) -> None:
    path = synth if model == "qwen3-30b-a3b-2L" else FIXTURES / MODELS[model]
    engine = Engine.load(path, "cuda", resident_experts=True)
    assert engine.place.ops.kernels
    scenario = SCENARIOS["torch"]
    want = {name: alone(engine, name, steps) for name, (_, steps) in scenario.items()}
    got = batched(engine, scenario)
    worst = 0.0
    for name in scenario:
        assert got[name][0] == want[name][0], f"{model} {name}: greedy tokens differ"
        for g, w in zip(got[name][1], want[name][1], strict=True):
            worst = max(worst, (g - w).abs().max().item())
            assert (g - w).abs().max().item() <= 1e-4 * w.abs().max().item()
    print(f"{model}: largest |batched - alone| {worst:.3g}")
