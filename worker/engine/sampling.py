"""Next-token choice from one row of logits: greedy (argmax, ties to the lower id, as llama.cpp),
or temperature with top-k and top-p, from a seeded generator so a run can be repeated.

Before the choice, OpenAI's adjustments, in its order: the presence and frequency penalties from
the counts of the tokens generated so far (`logit[j] -= count[j] * frequency + (count[j] > 0) *
presence`), then `logit_bias` added. They change what is chosen, never the logits given: a caller's
log-probabilities (the model's distribution) are computed from the same tensor, unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: -2..2
MAX_LOGIT_BIAS = 100.0  # and for each logit_bias value: -100..100


@dataclass
class Sampler:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    _generator: torch.Generator = field(init=False, repr=False)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must lie in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got {value!r}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: token {token} must be an id >= 0 and its bias lie in "
                                 f"-{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}, got {bias!r}")
        self._generator = torch.Generator().manual_seed(self.seed)
        if self.logit_bias:
            self._bias = (torch.tensor(list(self.logit_bias), dtype=torch.int64),
                          torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))

    @property
    def penalizes(self) -> bool:
        """Whether the choice needs the counts of the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty)

    def adjusted(self, logits: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the choice is made from: penalties from `counts` ([V], how often each token was
        generated so far), then the bias. A new tensor when anything applies; `logits` is never written."""
        if counts is not None and self.penalizes:
            counts = counts.to(logits.device, torch.float32)
            logits = logits - counts * self.frequency_penalty - (counts > 0).to(torch.float32) * self.presence_penalty
        if self._bias is not None:
            ids, values = self._bias
            if int(ids.max()) >= logits.numel():
                raise ValueError(f"logit_bias names token {int(ids.max())}; the model has {logits.numel()} tokens")
            logits = logits.index_add(0, ids.to(logits.device), values.to(logits.device))
        return logits

    def __call__(self, logits: torch.Tensor, counts: torch.Tensor | None = None) -> int:
        logits = self.adjusted(logits.to(torch.float32).cpu(), counts)
        if self.temperature == 0:
            return int(torch.argmax(logits))  # first maximum: the lower id on ties
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self._generator))
