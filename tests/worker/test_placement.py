"""worker/nn/placement.py: `--device` lists parsed or refused in one line; the layer split is
contiguous, covers every layer exactly once, and is the min-max optimum (checked against every
possible split); a Placement puts each tensor on its layer's device and moves the step's state
only where a range starts."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from expertpack.worker.nn.placement import (DeviceSpecError, LayerCost, Placement, device_spec, layer_costs,
                                         parse_devices, split_layers, tensor_layer)
from expertpack.worker.weights.qtensor import QTensor
from gguf import GGMLQuantizationType as T


# ---- device specs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,n_cuda,want", [
    ("cpu", 0, ["cpu"]),
    ("cpu,cpu", 0, ["cpu", "cpu"]),
    (" cpu , cpu ,cpu", 0, ["cpu", "cpu", "cpu"]),
    ("cuda", 1, ["cuda"]),
    ("cuda:1", 2, ["cuda:1"]),
    ("cuda:0,cuda:1", 2, ["cuda:0", "cuda:1"]),
    ("cuda:3,cuda:0,cuda:2", 4, ["cuda:3", "cuda:0", "cuda:2"]),  # the order given is the pipeline's order
])
def test_device_specs(spec: str, n_cuda: int, want: list[str]) -> None:
    devices = parse_devices(spec, n_cuda)
    assert [str(d) for d in devices] == want
    assert parse_devices(device_spec(devices), n_cuda) == devices


@pytest.mark.parametrize("spec,n_cuda,needle", [
    ("", 2, "expected cpu, cuda or cuda:N"),
    ("bogus", 2, "--device 'bogus': expected cpu, cuda or cuda:N"),
    ("cuda:0,,cuda:1", 2, "expected cpu, cuda or cuda:N"),
    ("meta", 2, "runs on cpu or cuda, not meta"),
    ("cuda:0,cuda:0", 2, "cuda:0 is named twice"),
    ("cuda:0,cuda:2", 2, "cuda:2 is not visible: this process sees 2 CUDA devices (cuda:0..cuda:1)"),
    ("cuda:0,cuda:1", 0, "no CUDA device is usable here"),
    ("cpu,cuda:0", 2, "mixes cpu and cuda"),
    ("cuda,cuda:1", 2, "name each GPU of a list by its index"),
    ("cpu:1", 0, "the CPU has no numbered devices"),
])
def test_bad_device_specs_say_why(spec: str, n_cuda: int, needle: str) -> None:
    with pytest.raises(DeviceSpecError) as err:
        parse_devices(spec, n_cuda)
    message = str(err.value)
    assert needle in message and "\n" not in message, message


# ---- the split ------------------------------------------------------------------------------------
def brute_force(costs: list[int], n_parts: int, first: int, last: int) -> int:
    """The least largest part over every way to cut len(costs) layers into n_parts non-empty ranges."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), n_parts - 1):
        bounds = [0, *cuts, len(costs)]
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts[0] += first
        parts[-1] += last
        best = max(parts) if best is None else min(best, max(parts))
    return best


def largest(ranges: tuple[range, ...], costs: list[int], first: int, last: int) -> int:
    parts = [sum(costs[i] for i in r) for r in ranges]
    parts[0] += first
    parts[-1] += last
    return max(parts)


def check_cover(ranges: tuple[range, ...], n_layer: int, n_parts: int) -> None:
    assert len(ranges) == n_parts
    assert ranges[0].start == 0 and ranges[-1].stop == n_layer
    assert all(len(r) > 0 and r.step == 1 for r in ranges)
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    assert sorted(i for r in ranges for i in r) == list(range(n_layer))  # every layer exactly once


def test_split_is_the_min_max_optimum_on_random_costs() -> None:
    rng = random.Random(16)
    for _ in range(300):
        n_layer = rng.randint(1, 9)
        n_parts = rng.randint(1, n_layer)
        costs = [rng.choice([0, 1, 5, rng.randint(0, 100)]) for _ in range(n_layer)]
        first, last = rng.choice([0, 0, rng.randint(0, 200)]), rng.choice([0, rng.randint(0, 200)])
        ranges = split_layers(costs, n_parts, first, last)
        check_cover(ranges, n_layer, n_parts)
        assert largest(ranges, costs, first, last) == brute_force(costs, n_parts, first, last), (costs, n_parts)


def test_split_balances_equal_layers_evenly_and_heavy_ends_move_the_cuts() -> None:
    assert split_layers([10] * 8, 2) == (range(0, 4), range(4, 8))
    assert split_layers([10] * 9, 3) == (range(0, 3), range(3, 6), range(6, 9))
    assert split_layers([10] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    # a large head on the last device: it takes fewer layers
    assert split_layers([10] * 8, 2, last_extra=20) == (range(0, 5), range(5, 8))
    # dense leading layers read no experts: the MoE layers' reads weigh in
    dense, moe = LayerCost(10, 0), LayerCost(10, 30)
    costs = [c.total for c in [dense, dense, dense, moe, moe, moe]]
    assert split_layers(costs, 2) == (range(0, 4), range(4, 6))
    # deterministic: the same answer every time
    assert len({split_layers([3, 1, 4, 1, 5, 9, 2, 6], 3) for _ in range(5)}) == 1


def test_split_scales_to_real_depths() -> None:
    """93 layers (Kimi-K3) over 8 devices: quick, and no range more than one layer above the mean."""
    ranges = split_layers([100] * 93, 8)
    check_cover(ranges, 93, 8)
    assert max(len(r) for r in ranges) == 12


@pytest.mark.parametrize("n_layer,n_parts,needle", [
    (2, 3, "3 devices for a model of 2 layers: each device needs at least one layer; name at most 2 devices"),
    (4, 0, "cannot split 4 layers into 0 parts"),
])
def test_split_refuses_what_cannot_be_split(n_layer: int, n_parts: int, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        split_layers([1] * n_layer, n_parts)
    assert needle in str(err.value)


def q(name: str, nbytes: int) -> QTensor:
    """A trunk tensor of `nbytes` (float32 zeros)."""
    return QTensor(name, T.F32, (nbytes // 4,), torch.zeros(nbytes, dtype=torch.uint8))


def test_layer_costs_count_block_tensors_and_expert_reads() -> None:
    trunk = {t.name: t for t in [q("token_embd.weight", 400), q("blk.0.attn_q.weight", 40), q("blk.0.ffn_norm.weight", 8),
                                 q("blk.1.attn_q.weight", 40), q("blk.10.attn_q.weight", 4), q("output.weight", 400)]}
    assert tensor_layer("blk.10.attn_q.weight") == 10 and tensor_layer("output.weight") is None
    costs = layer_costs(trunk, 2, {1: 3 * 4096})
    assert costs == [LayerCost(48, 0), LayerCost(40, 3 * 4096)]


def test_plan_counts_the_embedding_on_the_first_device_only_where_it_is_held_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs the token embedding stays in pinned host memory (Placement.weights), so it weighs
    nothing on the first GPU and the layers split evenly; on CPUs it is the first device's, and its
    bytes move the cut forward."""
    from expertpack.worker.nn import placement
    from expertpack.worker.weights.model_files import ModelFiles

    trunk = {t.name: t for t in [q("token_embd.weight", 4000), q("output.weight", 100),
                                 *(q(f"blk.{i}.attn_q.weight", 100) for i in range(6))]}
    files = ModelFiles("qwen3moe", {"qwen3moe.block_count": 6, "qwen3moe.expert_used_count": 1}, trunk, None, None)
    monkeypatch.setattr(placement, "expert_layers", lambda files: {})  # no routed experts: the trunk alone
    gpus = placement.plan(files, [torch.device("cuda", 0), torch.device("cuda", 1)])
    cpus = placement.plan(files, [torch.device("cpu"), torch.device("cpu")])
    assert gpus.starts == (0, 3) and cpus.starts == (0, 1)


# ---- the placement ---------------------------------------------------------------------------------
def test_placement_places_tensors_and_hops_only_at_range_starts() -> None:
    a, b, c = torch.device("cpu"), torch.device("cpu"), torch.device("cpu")
    place = Placement.over([a, b, c], split_layers([1] * 7, 3))
    assert place.starts == (0, 2, 4) and place.split  # among equal optima the earliest cuts
    assert [place.part_of(i) for i in range(7)] == [0, 0, 1, 1, 2, 2, 2]
    assert place.ranges(7) == (range(0, 2), range(2, 4), range(4, 7))
    assert place.tensor_device("token_embd.weight") is a and place.tensor_device("output_hc_fn.weight") is c
    assert place.tensor_device("blk.3.attn_q.weight") is b and place.device_of(4) is c
    x, bank = torch.ones(2), [torch.zeros(1)]
    for layer in range(7):
        moved = place.hop(layer, x, bank, None, 3)
        assert moved[2:] == (None, 3)
        if layer in (2, 4):
            assert torch.equal(moved[0], x) and torch.equal(moved[1][0], bank[0])
        else:
            assert moved[0] is x and moved[1] is bank  # inside a range nothing moves


@pytest.mark.parametrize("ranges", [
    [range(0, 2), range(3, 5)],  # a gap
    [range(1, 3), range(3, 5)],  # not from layer 0
    [range(0, 2), range(2, 2)],  # an empty range
    [range(0, 5)],  # one range for two devices
])
def test_placement_refuses_ranges_that_are_not_a_pipeline(ranges: list[range]) -> None:
    with pytest.raises(ValueError):
        Placement.over([torch.device("cpu")] * 2, ranges)
