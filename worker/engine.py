"""Prefill and decode over one model and one KV cache: logits for a prompt, then one token at a
time, greedy or sampled. No HTTP, no daemon: the expert source decides where experts come from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .layers import KVCache
from .daemon_link import DaemonLink
from .expert_cache import ExpertCache
from .model_files import ModelFiles, PackExperts, ResidentExperts, expert_layers, open_model
from .models import model_module
from .sampling import Sampler


@dataclass
class Engine:
    model: object
    files: ModelFiles
    device: torch.device

    @classmethod
    def load(cls, path: Path | str, device: str = "cpu", resident_experts: bool = False,
             daemon: str | None = None, cache_bytes: int = 0, reserve_bytes: int = 0,
             name: str = "expert-worker", daemon_timeout_s: float = 30.0, down_timeout_s: float = 60.0) -> "Engine":
        """Experts come from: the pack or GGUF directly (default), every expert on the device
        (resident_experts), or a device cache of `cache_bytes` fed by expertd at `daemon` (path
        must then be the pack the daemon serves: the fingerprints are checked at HELLO). A request
        the daemon leaves unanswered for daemon_timeout_s counts as the daemon gone; the worker
        reconnects and fails with DaemonLost once it has been gone for down_timeout_s."""
        files = open_model(path)
        dev = torch.device(device)
        if daemon is not None and not isinstance(files.experts, PackExperts):
            raise ValueError(f"{path}: a daemon serves packs; give the pack directory, not a GGUF")
        if resident_experts:
            on_disk = files.experts
            files.experts = ResidentExperts(on_disk, expert_layers(files), dev)
            on_disk.close()
        model = model_module(files.arch).Model(files, dev)
        if daemon is not None:  # after the trunk is on the device: the cache takes what is left
            link = DaemonLink(daemon, files.fingerprint, dev, name=name, timeout_s=daemon_timeout_s,
                              down_timeout_s=down_timeout_s)
            try:
                cache = ExpertCache(files.experts.manifest, link, dev, cache_bytes, reserve_bytes)
            except BaseException:
                link.close()
                raise
            files.experts.close()  # the daemon reads the pack from now on
            files.experts = model.moe.source = cache
        return cls(model, files, dev)

    @property
    def expert_cache(self) -> ExpertCache | None:
        source = self.model.moe.source
        return source if isinstance(source, ExpertCache) else None

    def close(self) -> None:
        """Waits for the cache's copies, gives the staging back and leaves the daemon; closes the
        files experts are read from."""
        if hasattr(self.files.experts, "close"):
            self.files.experts.close()

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
