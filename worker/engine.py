"""Prefill and decode over one model and one KV cache: logits for a prompt, then one token at a
time, greedy or sampled. No HTTP, no daemon: the expert source decides where experts come from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .layers import KVCache
from .model_files import ModelFiles, ResidentExperts, expert_layers, open_model
from .models import model_module
from .sampling import Sampler


@dataclass
class Engine:
    model: object
    files: ModelFiles
    device: torch.device

    @classmethod
    def load(cls, path: Path | str, device: str = "cpu", resident_experts: bool = False) -> "Engine":
        """resident_experts: load every expert onto the device once instead of reading per use."""
        files = open_model(path)
        dev = torch.device(device)
        if resident_experts:
            files.experts = ResidentExperts(files.experts, expert_layers(files), dev)
        return cls(model_module(files.arch).Model(files, dev), files, dev)

    def new_cache(self) -> KVCache:
        return KVCache()

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: KVCache) -> torch.Tensor:
        """Logits [len(tokens), n_vocab] (float32) after each token, continuing the cache."""
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        return self.model.forward(ids, cache).to(torch.float32)

    def generate(self, prompt: list[int], n: int, sampler: Sampler, cache: KVCache | None = None,
                 stop: set[int] = frozenset()) -> tuple[list[int], torch.Tensor]:
        """Prompt logits [len(prompt), V] and up to n new tokens (stopping after a `stop` token)."""
        cache = cache or self.new_cache()
        logits = self.forward(prompt, cache)
        prompt_logits = logits
        out: list[int] = []
        for _ in range(n):
            token = sampler(logits[-1])
            out.append(token)
            if token in stop or len(out) == n:
                break
            logits = self.forward([token], cache)
        return out, prompt_logits
