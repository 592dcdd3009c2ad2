"""Synthetic GGUFs of a given architecture and metadata (through `expertpack synth`'s own writer),
and loading their exact values into a transformers model: how architectures and features the
llama.cpp fixtures do not cover (qwen2moe, DeepSeek's YaRN, gpt-oss past its sliding window) are
checked against an implementation nobody here wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from expertpack.packtools.synth import presets
from expertpack.packtools.synth.presets import Preset
from expertpack.packtools.synth.writer import SynthOptions, write_synth
from expertpack.worker.experts.source import ExpertWeights
from expertpack.worker.weights.model_files import open_model


def synth_gguf(path: Path, arch: str, meta: dict[str, Any], n_vocab: int, expert_type: str = "F32",
               trunk_type: str = "F32", family: str = "chatml", pre: str = "qwen2", seed: int = 5) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setitem(presets.PRESETS, "under-test", Preset(arch, "test", n_vocab, family, pre, expert_type, trunk_type, meta))
    try:
        write_synth(path, SynthOptions(preset="under-test", progress=False, seed=seed))
    finally:
        mp.undo()
    return path


def gguf_values(path: Path, moe_layers: range, n_expert: int) -> tuple[dict[str, torch.Tensor], dict[int, dict[int, ExpertWeights]]]:
    """Trunk tensors dequantized (torch order) and the raw expert weights of every MoE layer."""
    files = open_model(path)
    trunk = {name: t.dequant() for name, t in files.trunk.items()}
    return trunk, {layer: files.experts.load(layer, range(n_expert)) for layer in moe_layers}


def stack(experts: dict[int, ExpertWeights], role: str) -> torch.Tensor:
    return torch.stack([experts[e][role].dequant() for e in sorted(experts)])


def load_exactly(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
