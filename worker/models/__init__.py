"""The architectures the worker runs, keyed by GGUF `general.architecture`: the one place that says
what is supported. Each module exports `Args`, `KEYS` (its metadata table) and `Model`."""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from ..nn.layers import KVCache
from ..nn.moe import ExpertFFN
from . import deepseek2, deepseek4, gpt_oss, kimi_k3, llama, qwen2moe, qwen3moe

ARCHITECTURES: dict[str, ModuleType] = {
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "llama": llama,
    "gpt-oss": gpt_oss,
    "deepseek2": deepseek2,
    "deepseek4": deepseek4,
    "kimi-k3": kimi_k3,
}


class Model(Protocol):
    """What every architecture's Model is to the engine."""

    moe: ExpertFFN  # the one MoE entry point, and through it the expert source
    static_decode: bool  # a one-token step has the same shapes at every position (CUDA graphs)
    static_prompt: bool  # so has a short prompt (engine.STATIC_PROMPT_MAX_TOKENS)
    # An architecture with its own per-layer states (KVCache.state) that a static prompt can start
    # from also has `new_states() -> dict[int, LayerCache]`: the states before a first token.

    def forward(self, tokens: torch.Tensor, cache: KVCache, last: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens [T] (on the device) -> logits [T, n_vocab] (the last `last` positions' only where
        it is not 0; True: the last one's; a tensor of positions: theirs, ops.output_logits);
        continues the cache. The models with `batched_decode` also take a BatchKV: several
        sequences' tokens in one pass."""
        ...


class UnsupportedArchitecture(ValueError):
    pass


def model_module(arch: str) -> ModuleType:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported by this worker; it runs {', '.join(sorted(ARCHITECTURES))}"
        ) from None
