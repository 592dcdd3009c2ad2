"""Next-token choice from one row of logits: greedy (argmax, ties to the lower id, as llama.cpp),
or temperature with top-k and top-p, from a seeded generator so a run can be repeated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sampler:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
        self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.to(torch.float32).cpu()
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
