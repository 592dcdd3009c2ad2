"""Next-token choice from one row of logits: greedy (argmax, ties to the lower id, as llama.cpp),
or temperature with top-k and top-p, from a seeded generator so a run can be repeated.

The choice is made on the logits' own device and only the chosen id comes back to the host: copying
the whole vocabulary every token would put a device-to-host transfer of the full row on each decode
step's critical path. The random generator is per device (seeded from `seed`, made on first use), so
on the CPU a seed draws the same tokens as it always has; on an accelerator it draws from that
device's generator, the same distribution, a different stream.

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
    # Made once per device and kept: the generator's stream must continue from token to token, and
    # the bias is uploaded once rather than each step.
    _generators: dict[torch.device, torch.Generator] = field(init=False, repr=False, default_factory=dict)
    _biases: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False,
                                                                         default_factory=dict)
    _max_bias_id: int = field(init=False, repr=False, default=-1)  # checked on the host, no device sync

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
        if self.logit_bias:
            self._biases[torch.device("cpu")] = (torch.tensor(list(self.logit_bias), dtype=torch.int64),
                                                 torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))
            self._max_bias_id = max(self.logit_bias)

    @property
    def penalizes(self) -> bool:
        """Whether the choice needs the counts of the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """Whether the choice is the logits' argmax as they are (no temperature, penalty nor bias):
        several rows' then come from one argmax over all of them, the same ids."""
        return self.temperature == 0 and not self.penalizes and not self.logit_bias

    def adjusted(self, logits: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the choice is made from: penalties from `counts` ([V], how often each token was
        generated so far), then the bias. A new tensor when anything applies; `logits` is never written."""
        if counts is not None and self.penalizes:
            counts = counts.to(logits.device, torch.float32)
            logits = logits - counts * self.frequency_penalty - (counts > 0).to(torch.float32) * self.presence_penalty
        if self.logit_bias:
            if self._max_bias_id >= logits.numel():
                raise ValueError(f"logit_bias names token {self._max_bias_id}; the model has {logits.numel()} tokens")
            ids, values = self._bias_on(logits.device)
            logits = logits.index_add(0, ids, values)
        return logits

    def _bias_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bias's ids and values on `device`, uploaded on first use."""
        if device not in self._biases:
            ids, values = self._biases[torch.device("cpu")]
            self._biases[device] = (ids.to(device), values.to(device))
        return self._biases[device]

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """`device`'s generator, seeded from `seed` on first use."""
        if device not in self._generators:
            # On the CPU the very generator the sampler has always used: a seed's tokens stay the same.
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, counts: torch.Tensor | None = None) -> int:
        """The chosen token id for `logits` ([V], any float dtype, any device; `counts` on the same
        device). The one value copied to the host is that id."""
        logits = self.adjusted(logits.to(torch.float32), counts)
        if self.temperature == 0:
            return int(torch.argmax(logits))  # torch documents the first maximum: the lower id on ties
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p  # the smallest set reaching top_p
            # Zeros written back for the dropped tokens rather than a boolean index: the same values,
            # without the device sync that a data-dependent shape would cost.
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(~keep, 0.0))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self._generator_on(probs.device)))
