"""The sampler works on the logits' device and returns only the chosen id; on the CPU it chooses
exactly what the host-side sampler it replaced chose (kept here as `reference_choice`), for bf16
logits too, and its draws follow the distribution temperature, top-k and top-p define. Tests run
on every device this machine has."""

from __future__ import annotations

import math

import pytest
import torch

from expertpack.worker.engine.sampling import Sampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_choice(s: Sampler, generator: torch.Generator, logits: torch.Tensor,
                     counts: torch.Tensor | None) -> int:
    """The sampler before it moved to the logits' device: everything on the host in float32."""
    logits = logits.to(torch.float32).cpu()
    if counts is not None and s.penalizes:
        counts = counts.cpu().to(torch.float32)
        logits = logits - counts * s.frequency_penalty - (counts > 0).to(torch.float32) * s.presence_penalty
    if s.logit_bias:
        ids = torch.tensor(list(s.logit_bias), dtype=torch.int64)
        logits = logits.index_add(0, ids, torch.tensor(list(s.logit_bias.values()), dtype=torch.float32))
    if s.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < s.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


SETTINGS = [
    {},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.3, "top_k": 40, "seed": 5},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"temperature": 1.0, "top_k": 100, "top_p": 0.8, "seed": 8, "presence_penalty": 0.5,
     "frequency_penalty": -0.3, "logit_bias": {3: 2.5, 17: -100.0, 499: 7.0}},
    {"presence_penalty": 1.5, "frequency_penalty": 0.4, "logit_bias": {0: 3.0, 250: 1.0}},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", SETTINGS, ids=range(len(SETTINGS)))
def test_cpu_choices_equal_the_host_sampler_for_a_seed(settings: dict, dtype: torch.dtype) -> None:
    """Same seed, same logits, same counts: token for token what the host sampler chose."""
    g = torch.Generator().manual_seed(1)
    sampler = Sampler(**settings)
    generator = torch.Generator().manual_seed(sampler.seed)
    counts = torch.zeros(500)
    got, want = [], []
    for _ in range(60):
        logits = (torch.randn(500, generator=g) * 3).to(dtype)
        got.append(sampler(logits, counts))
        want.append(reference_choice(sampler, generator, logits, counts))
        counts[want[-1]] += 1
    assert got == want


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_takes_the_first_maximum_on_the_device(device: str) -> None:
    """torch.argmax documents that it returns the first maximal value's index, on every device."""
    logits = torch.zeros(152_064, dtype=torch.bfloat16, device=device)
    logits[[7, 900, 151_000]] = 4.0
    assert Sampler()(logits) == 7
    logits[3] = float(torch.tensor(4.0, dtype=torch.bfloat16).item())
    assert Sampler()(logits) == 3
    # A bias that makes a tie with an earlier token: the earlier one wins.
    assert Sampler(logit_bias={2: 4.0})(logits) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_and_bias_on_bf16_equal_the_host_ones(device: str) -> None:
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(1000, generator=g) * 4).to(torch.bfloat16)
    counts = torch.zeros(1000)
    counts[[5, 5, 5, 60, 61, 999]] += 1
    sampler = Sampler(presence_penalty=-0.9, frequency_penalty=1.7, logit_bias={5: 12.0, 999: -3.5, 0: 0.25})
    got = sampler.adjusted(logits.to(device).to(torch.float32), counts.to(device))
    assert got.device.type == device
    want_logits = logits.to(torch.float32) - counts * 1.7 - (counts > 0).to(torch.float32) * -0.9
    want_logits[[5, 999, 0]] += torch.tensor([12.0, -3.5, 0.25])
    assert torch.equal(got.cpu(), want_logits)
    before = logits.clone()
    choice = sampler(logits.to(device), counts.to(device))
    assert choice == reference_choice(sampler, torch.Generator(), logits, counts)
    assert torch.equal(logits, before), "the logits given are never written"


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution temperature, top-k and top-p define, by a plain loop in float64."""
    scaled = [x / temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])[:top_k]
    top = max(scaled)
    z = sum(math.exp(scaled[i] - top) for i in order)
    p = {i: math.exp(scaled[i] - top) / z for i in order}
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i]
    return [p[i] / mass if i in kept else 0.0 for i in range(len(scaled))]


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_distribution(device: str) -> None:
    """4,000 draws with temperature, top-k and top-p: each token's frequency within 4.5 standard
    errors of its probability, and tokens outside top-k or the nucleus never drawn."""
    logits = torch.tensor([2.0, 1.6, 1.5, 0.9, 0.3, 0.2, -0.5, -1.0, -3.0, 2.2])
    temperature, top_k, top_p, n = 0.8, 7, 0.92, 4000
    want = expected_probs(logits, temperature, top_k, top_p)
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    on_device = logits.to(device)
    hist = [0] * logits.numel()
    for _ in range(n):
        hist[sampler(on_device)] += 1
    for i, p in enumerate(want):
        if p == 0:
            assert hist[i] == 0, f"token {i} is outside top-k/top-p and was drawn {hist[i]} times"
        else:
            se = math.sqrt(p * (1 - p) / n)
            assert abs(hist[i] / n - p) <= 4.5 * se, f"token {i}: frequency {hist[i] / n:.4f}, expected {p:.4f}"
    assert sum(1 for p in want if p == 0) >= 3, "the settings should exclude some tokens"
