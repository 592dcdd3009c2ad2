"""Real i-quant GGUFs, made by llama.cpp's own llama-imatrix and llama-quantize from the fixtures'
BF16/F16 files (tests/fixtures/iq: README.md, make.sh): routed experts mixed per role and per
layer as the low-bit "dynamic" GGUFs are, and the trunk as llama-quantize's IQ ftypes choose
(IQ2_XXS queries, an IQ3_S token embedding, IQ4_NL attention, Q5_1, ...). Every i-quant and
ternary type is in them at least once. The CPU engine's logits on each file equal, bit for bit,
its logits on a copy whose i-quant tensors are gguf-py's float32 dequantization of them: the
decoders are gguf-py's on real llama.cpp bytes (tests/kernels/test_fused_models.py holds the
kernels to this path on them); the pack gives the GGUF's bits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader

from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.worker.engine.engine import Engine

from ..conftest import IQ_FIXTURES
from ..helpers.gguf_float import I_QUANTS, float_copy

FILES = ["qwen3moe-a.IQ-mix.gguf", "deepseek3-a.IQ-mix.gguf", "mixtral-a.IQ-mix.gguf"]
TOKENS = [1, 5, 9, 200, 33, 17, 4, 81, 2, 77, 300, 12, 8, 64, 3, 5, 19, 250]
EXPERT_TYPES = {  # (file, layer, role) -> type, as make.sh asked llama-quantize for them
    ("qwen3moe-a.IQ-mix.gguf", 0, "gate"): T.IQ1_S, ("qwen3moe-a.IQ-mix.gguf", 0, "up"): T.IQ1_M,
    ("qwen3moe-a.IQ-mix.gguf", 0, "down"): T.IQ2_XS, ("qwen3moe-a.IQ-mix.gguf", 1, "gate"): T.IQ2_XXS,
    ("qwen3moe-a.IQ-mix.gguf", 1, "up"): T.IQ2_S, ("qwen3moe-a.IQ-mix.gguf", 1, "down"): T.IQ3_XXS,
    ("deepseek3-a.IQ-mix.gguf", 1, "gate"): T.IQ3_S, ("deepseek3-a.IQ-mix.gguf", 1, "up"): T.IQ4_XS,
    ("deepseek3-a.IQ-mix.gguf", 1, "down"): T.IQ4_NL, ("deepseek3-a.IQ-mix.gguf", 2, "gate"): T.TQ1_0,
    ("deepseek3-a.IQ-mix.gguf", 2, "up"): T.TQ2_0, ("deepseek3-a.IQ-mix.gguf", 2, "down"): T.IQ4_XS,
    **{("mixtral-a.IQ-mix.gguf", layer, role): (T.IQ2_S if role == "down" else T.IQ1_M)
       for layer in (0, 1) for role in ("gate", "up", "down")},
}


def expert_types(name: str) -> dict[tuple[str, int, str], T]:
    out = {}
    for t in GGUFReader(IQ_FIXTURES / name).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2].endswith("_exps"):
            out[(name, int(parts[1]), parts[2].removeprefix("ffn_").removesuffix("_exps"))] = t.tensor_type
    return out


def test_the_files_hold_every_i_quant_type_in_their_experts_as_asked() -> None:
    found = {}
    for name in FILES:
        found.update(expert_types(name))
    assert found == EXPERT_TYPES
    assert set(found.values()) == I_QUANTS


@pytest.mark.parametrize("name", FILES)
def test_logits_equal_the_gguf_py_dequantized_reference(name: str, tmp_path: Path) -> None:
    src = IQ_FIXTURES / name
    reference = float_copy(src, tmp_path / "f32.gguf", lambda _, ggml_type: ggml_type in I_QUANTS)
    kinds = Counter(t.tensor_type for t in GGUFReader(src).tensors if t.tensor_type in I_QUANTS and
                    "_exps" not in t.name)
    assert kinds, f"{name}: no trunk tensor of an i-quant type"

    def logits(path: Path) -> torch.Tensor:
        engine = Engine.load(path, "cpu")
        return engine.forward(TOKENS, engine.new_sequence())

    got, want = logits(src), logits(reference)
    assert torch.isfinite(got).all() and got.std() > 0.01
    # The CPU path multiplies the dequantized float32 matrices: gguf-py's values give the very bits.
    assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max():.3g}"


def test_the_pack_gives_the_ggufs_bits(tmp_path: Path) -> None:
    src = IQ_FIXTURES / "deepseek3-a.IQ-mix.gguf"
    pack = tmp_path / "pack"
    build_pack(src, pack, BuildOptions(progress=False, safety_margin_bytes=0))
    direct, packed = Engine.load(src), Engine.load(pack)
    assert torch.equal(direct.forward(TOKENS, direct.new_sequence()), packed.forward(TOKENS, packed.new_sequence()))
