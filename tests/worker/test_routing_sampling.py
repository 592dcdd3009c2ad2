"""Routing functions against a naive per-token loop, sampling's contract, and model-loading errors
that must name what is wrong."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.models import UnsupportedArchitecture, model_module
from expertpack.worker.models.config import ConfigError, Key, read_args
from expertpack.worker.nn.routing import sigmoid_group_topk, softmax_topk, topk_softmax


def naive_softmax_topk(row: list[float], k: int, normalize: bool) -> dict[int, float]:
    m = max(row)
    e = [pow(2.718281828459045, x - m) for x in row]
    p = [x / sum(e) for x in e]
    top = sorted(range(len(p)), key=lambda i: -p[i])[:k]
    total = sum(p[i] for i in top)
    return {i: (p[i] / total if normalize else p[i]) for i in top}


def naive_group_topk(row: list[float], bias: list[float], k: int, n_group: int, topk_group: int, scale: float):
    import math
    s = [1 / (1 + math.exp(-x)) for x in row]
    b = [x + y for x, y in zip(s, bias)]
    size = len(row) // n_group
    group_score = [sum(sorted(b[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
    keep = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    candidates = [i for g in keep for i in range(g * size, (g + 1) * size)]
    top = sorted(candidates, key=lambda i: -b[i])[:k]
    total = sum(s[i] for i in top)
    return {i: s[i] / total * scale for i in top}


def as_dict(ids: torch.Tensor, w: torch.Tensor, t: int) -> dict[int, float]:
    return {int(i): float(x) for i, x in zip(ids[t], w[t])}


def test_softmax_topk_against_a_loop() -> None:
    logits = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    for normalize in (True, False):
        ids, w = softmax_topk(logits, 4, normalize)
        for t in range(20):
            want = naive_softmax_topk(logits[t].tolist(), 4, normalize)
            got = as_dict(ids, w, t)
            assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-6 for i in want)


def test_topk_softmax_against_a_loop() -> None:
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(1))
    ids, w = topk_softmax(logits, 3)
    for t in range(20):
        top = sorted(range(8), key=lambda i: -float(logits[t, i]))[:3]
        want = naive_softmax_topk([float(logits[t, i]) for i in top], 3, False)
        assert set(ids[t].tolist()) == set(top)
        assert sorted(w[t].tolist()) == pytest.approx(sorted(want.values()), abs=1e-6)


def test_sigmoid_group_topk_against_a_loop() -> None:
    g = torch.Generator().manual_seed(2)
    logits, bias = torch.randn(30, 16, generator=g), torch.rand(16, generator=g) * 0.3
    ids, w = sigmoid_group_topk(logits, bias, 4, n_group=4, topk_group=2, normalize=True, scale=2.5)
    for t in range(30):
        want = naive_group_topk(logits[t].tolist(), bias.tolist(), 4, 4, 2, 2.5)
        got = as_dict(ids, w, t)
        assert got.keys() == want.keys() and all(abs(got[i] - want[i]) < 1e-5 for i in want)


def test_greedy_takes_the_lower_id_on_ties_and_top_k_1_is_greedy() -> None:
    assert Sampler()(torch.tensor([0.5, 2.0, 2.0, -1.0])) == 1
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0])
    assert {Sampler(temperature=1.0, top_k=1, seed=s)(logits) for s in range(20)} == {1}


def test_sampling_is_reproducible_and_respects_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    a = Sampler(temperature=1.0, seed=7)
    b = Sampler(temperature=1.0, seed=7)
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]
    nucleus = Sampler(temperature=1.0, top_p=0.7, seed=3)
    assert {nucleus(logits) for _ in range(300)} == {0, 1}  # 0.5 + 0.3 reach 0.7; 2 and 3 never
    everything = Sampler(temperature=1.0, seed=4)
    assert {everything(logits) for _ in range(400)} == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        Sampler(top_p=0)


def test_the_sampler_penalizes_from_a_copy_and_refuses_what_it_cannot_apply() -> None:
    """What the API's penalties and logit_bias rest on, against a naive loop: the choice is made from
    adjusted logits; the logits given (whose log-softmax is the logprob) are never written."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(50, generator=g)
    counts = torch.zeros(50)
    counts[[3, 3, 7, 11]] += 1
    sampler = Sampler(presence_penalty=0.7, frequency_penalty=-1.2, logit_bias={7: 5.0, 49: -100.0})
    before = logits.clone()
    got = sampler.adjusted(logits, counts)
    assert torch.equal(logits, before)
    want = before.tolist()
    for t, c in enumerate(counts.tolist()):
        if c:
            want[t] -= c * -1.2 + 0.7
    want[7] += 5.0
    want[49] -= 100.0
    assert torch.allclose(got, torch.tensor(want), atol=1e-6, rtol=0)
    assert sampler(logits, counts) == max(range(50), key=lambda i: (want[i], -i))
    with pytest.raises(ValueError, match="names token 50; the model has 50"):
        Sampler(logit_bias={50: 1.0})(logits)
    with pytest.raises(ValueError, match="presence_penalty must lie in -2..2"):
        Sampler(presence_penalty=float("nan"))


def test_missing_metadata_is_listed_all_at_once() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Args:
        a: int
        b: int
        c: int = 3

    with pytest.raises(ConfigError, match="qwen3moe.block_count, qwen3moe.expert_count"):
        read_args(Args, "qwen3moe", {}, {"a": Key("block_count"), "b": Key("expert_count"), "c": Key("x", 3)})


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitecture, match="qwen3moe"):
        model_module("mamba")
