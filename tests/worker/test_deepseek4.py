"""DeepSeek-V4 (`deepseek4`) against references nobody here wrote (tests/fixtures/flagship):

- the BF16 GGUF (MXFP4 experts, as the converter always writes them) against transformers'
  float32 DeepseekV4ForCausalLM, teacher-forced along its greedy tokens, on both prompts (the long
  one, 150 tokens, reaches HCA's first 128-token window as well as CSA and the sliding window):
  we compute in float32 on the same values, so rows differ by summation order only: measured max
  |Δlogit| 2.6e-6, tolerance 1e-4, cosine per row >= 0.999999. The experts chosen on every layer
  and token of the prompt equal transformers' (hash and top-k layers alike), and the 16 greedy
  tokens decoded one at a time through the caches are transformers' own. (The lightning indexer
  picks with torch.topk as transformers does; where compressed entries tie at its last pick, most
  often several scoring exactly 0 after its ReLU, a decode step may pick another one than one long
  pass: the long prompt has such positions, recorded in the layer state, and decoding stays
  within 0.02 of the one-pass logits there.)
- the Q2_K GGUF against transformers run on that file's dequantized weights (stored as float16):
  measured <= 9.8e-4, the storage's rounding; tolerance 2e-3.
- through the pack and a real expertd with a minimal cache: bit for bit the in-process logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler

from ..conftest import FIXTURES
from ..helpers.engine import assert_served_equals_direct

DS4 = FIXTURES / "flagship" / "deepseek4"
REF = json.loads((DS4 / "reference.json").read_text())
PROMPTS = ("short", "long")


def prompt(name: str) -> list[int]:
    return REF["prompts"][name]["ids"]


@pytest.fixture(scope="module")
def bf16() -> Engine:
    return Engine.load(DS4 / "dsv4-tiny.BF16.gguf")


@pytest.mark.parametrize("name", PROMPTS)
def test_bf16_matches_transformers(bf16: Engine, name: str) -> None:
    hf = REF["reference_transformers"]["prompts"][name]
    want = np.load(DS4 / "logits" / f"transformers_{name}.f32.npy")
    bf16.model.moe.routing_log = {}
    cache = bf16.new_sequence()
    got = bf16.forward(prompt(name) + hf["greedy_ids"], cache).numpy()
    log, bf16.model.moe.routing_log = bf16.model.moe.routing_log, None
    diff = np.abs(got - want).max(axis=1)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert diff.max() <= 1e-4 and cosine.min() >= 0.999999, f"{name}: max |diff| {diff.max():.3g}"
    n = len(prompt(name))
    for layer, calls in log.items():
        ours = np.sort(calls[0][:n].numpy(), axis=-1)
        theirs = np.sort(np.array(hf["routing_prompt_pass"][str(layer)]["topk"]), axis=-1)
        assert np.array_equal(ours, theirs), f"{name} layer {layer}: expert choices differ from transformers"


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_through_the_caches_is_transformers(bf16: Engine, name: str) -> None:
    want = REF["reference_transformers"]["prompts"][name]["greedy_ids"]
    tokens, _ = bf16.generate(prompt(name), len(want), Sampler())
    assert tokens == want
    one_pass = bf16.forward(prompt(name) + want, bf16.new_sequence())
    cache = bf16.new_sequence()
    stepwise = torch.cat([bf16.forward(prompt(name), cache)] + [bf16.forward([t], cache) for t in want[:-1]])
    diff = (stepwise - one_pass[:len(stepwise)]).abs().max(dim=1).values
    ties = {pos for state in cache.kv.state.values() for pos in state.indexer_ties}
    assert set(torch.nonzero(diff > 1e-4).flatten().tolist()) <= ties and diff.max() <= 0.02


def test_hash_layers_route_by_token_before_they_run(bf16: Engine) -> None:
    """The hash layers' experts are table[token]: registered in the expert seam for prefetching."""
    routes = bf16.model.moe.static_routes
    assert sorted(routes) == [0, 1]
    ids = prompt("short")
    bf16.model.moe.routing_log = {}
    bf16.forward(ids, bf16.new_sequence())
    log, bf16.model.moe.routing_log = bf16.model.moe.routing_log, None
    for layer, table in routes.items():
        assert torch.equal(log[layer][0], table[torch.tensor(ids)].to(torch.int64))


@pytest.mark.parametrize("name", PROMPTS)
def test_q2k_matches_its_dequantized_reference(name: str) -> None:
    engine = Engine.load(DS4 / "dsv4-tiny.Q2_K.gguf")
    greedy = REF["llama_cpp_outputs"]["Q2_K"]["prompts"][name]["greedy_ids"]
    want = np.load(DS4 / "logits" / f"dequant_Q2_K_{name}.f16.npy").astype(np.float32)
    got = engine.forward(prompt(name) + greedy, engine.new_sequence()).numpy()
    assert np.abs(got - want).max() <= 2e-3


def test_through_expertd_with_a_minimal_cache_is_bit_exact(fixture_packs, tmp_path: Path) -> None:
    assert_served_equals_direct(fixture_packs["dsv4-tiny.BF16"][1], prompt("long"), tmp_path)
