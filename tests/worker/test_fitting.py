"""--max-batch's default (serve/fitting.py): as many sequences as fit at the whole context in the
memory left, the KV bytes a position measured on the engine and held to the model's own layout."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine.engine import WARM_BATCH, Engine
from expertpack.worker.serve.fitting import PASS_BYTES, batch_that_fits, default_max_batch

from ..conftest import FIXTURES
from ..helpers.batched import MODELS

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("model", sorted(set(MODELS) - {"deepseek4"}))
@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu"])
def test_kv_bytes_a_position_are_what_a_sequence_holds(model: str, devices: str) -> None:
    """What the engine works out (every layer's keys and values) is what a sequence's buffers
    take a position once it ran, over one device and split over two."""
    engine = Engine.load(FIXTURES / MODELS[model], devices, resident_experts=True)
    with engine.new_sequence() as seq:
        engine.forward([1, 2, 3], seq)
        cache = seq.kv
        held = sum(t.numel() * t.element_size() for t in [*cache.keys.values(), *cache.values.values()])
        n_layer = engine.files.metadata[f"{engine.files.arch}.block_count"]
        assert not cache.state_tensors() and len(cache.keys) == n_layer
        assert sum(engine.kv_bytes_per_position().values()) * cache.capacity == held
    assert set(engine.kv_bytes_per_position()) == {CPU}


def test_deepseek4_bytes_a_position_are_what_its_states_reserve() -> None:
    """DeepSeek-V4 keeps no keys and values but per layer a compressed state: what the engine works
    out a position is what its reserved buffers grow by (compressed entries, the indexer's ties),
    the window's and the compressors' pending rows a fixed size besides."""
    engine = Engine.load(FIXTURES / MODELS["deepseek4"], resident_experts=True)

    def reserved(capacity: int) -> int:
        states = engine.model.new_states()
        for state in states.values():
            state.reserve(capacity, 0)
        return sum(t.numel() * t.element_size() for state in states.values() for t in state.tensors())

    per = engine.kv_bytes_per_position()
    assert set(per) == {CPU} and per[CPU] > 0
    assert reserved(2048) - reserved(1024) == per[CPU] * 1024


def test_the_model_says_its_own_layout() -> None:
    """qwen3moe: per layer a key and a value of head_count_kv x key_length float32 a position."""
    engine = Engine.load(FIXTURES / MODELS["qwen3moe"], resident_experts=True)
    md = engine.files.metadata
    heads, dim = int(md["qwen3moe.attention.head_count_kv"]), int(md["qwen3moe.attention.key_length"])
    assert engine.kv_bytes_per_position() == {CPU: int(md["qwen3moe.block_count"]) * 2 * heads * dim * 4}


@pytest.mark.parametrize("free,want", [
    ({GPU0: PASS_BYTES + 5 * 1000 * 100}, 5),  # five sequences of 1000 positions at 100 bytes
    ({GPU0: PASS_BYTES + 5 * 1000 * 100 - 1}, 4),  # a byte short of the fifth
    ({GPU0: PASS_BYTES // 2}, 1),  # less than the activations' share: one, never none
    ({GPU0: 1 << 50}, WARM_BATCH),  # no more than the warm-up captures
])
def test_the_batch_is_what_the_free_memory_holds(free: dict, want: int) -> None:
    assert batch_that_fits({GPU0: 100.0}, 1000, free) == want


def test_layers_over_two_devices_fit_the_tighter_one() -> None:
    per = {GPU0: 300.0, GPU1: 100.0}  # more layers on the first
    free = {GPU0: PASS_BYTES + 3 * 300 * 10, GPU1: PASS_BYTES + 9 * 100 * 10}
    assert batch_that_fits(per, 10, free) == 3
    assert batch_that_fits(per, 10, free, most=2) == 2


def test_a_model_of_one_sequence_a_step_defaults_to_one() -> None:
    engine = Engine.load(FIXTURES / "gguf/deepseek3-a/deepseek3-a.Q2_K.gguf", resident_experts=True)
    assert default_max_batch(engine, 4096) == (1, "deepseek2 runs one sequence a step")


def test_the_default_says_what_it_measured() -> None:
    engine = Engine.load(FIXTURES / MODELS["qwen3moe"], resident_experts=True)
    n, why = default_max_batch(engine, 4096)
    assert 1 <= n <= WARM_BATCH
    assert why.startswith("what fits (cpu: ") and "a sequence of 4096 positions" in why, why
