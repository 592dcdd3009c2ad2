"""synth writes the i-quant and ternary types, alone and mixed as llama.cpp's low-bit "dynamic" GGUFs
mix them (ffn_down_exps at more bits than gate/up, a layer at another type): gguf-py reads every
expert tensor back with the type asked for and dequantizes it to finite values; the pack builds and
verifies; inspect shows one line per mix; and the CPU engine's logits on the model equal, within
float32 summation noise, its logits on a copy whose experts are gguf-py's dequantized float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader, quants

from expertpack.packtools.errors import ExpertpackError
from expertpack.packtools.synth.writer import SynthOptions, plan_synth, write_synth

from ..helpers.gguf_float import float_copy

N_LAYER = 2
# id -> (--type, --mix, the expected type of each (layer, role))
CASES = {
    "IQ2_XXS": ("IQ2_XXS", None, {(l, r): T.IQ2_XXS for l in range(N_LAYER) for r in ("gate", "up", "down")}),
    "IQ1_S": ("IQ1_S", None, {(l, r): T.IQ1_S for l in range(N_LAYER) for r in ("gate", "up", "down")}),
    "IQ1_S-dynamic": ("IQ1_S", "down=IQ2_XXS,0=IQ3_XXS", {
        (0, "gate"): T.IQ3_XXS, (0, "up"): T.IQ3_XXS, (0, "down"): T.IQ3_XXS,
        (1, "gate"): T.IQ1_S, (1, "up"): T.IQ1_S, (1, "down"): T.IQ2_XXS}),
    "TQ2_0-IQ4_XS": ("TQ2_0", "down=IQ4_XS", {
        (l, r): (T.IQ4_XS if r == "down" else T.TQ2_0) for l in range(N_LAYER) for r in ("gate", "up", "down")}),
}


def options(case: str, **extra: object) -> SynthOptions:
    expert_type, mix, _ = CASES[case]
    return SynthOptions(preset="tiny", n_layer=N_LAYER, expert_type=expert_type, expert_mix=mix, progress=False,
                        **extra)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth-iq")
    return {case: write_synth(root / f"{case}.gguf", options(case))[0] for case in CASES}


def expert_role(name: str) -> tuple[int, str] | None:
    """blk.1.ffn_down_exps.weight -> (1, 'down'); None for any other tensor."""
    parts = name.split(".")
    if len(parts) != 4 or not parts[2].endswith("_exps"):
        return None
    return int(parts[1]), parts[2].removeprefix("ffn_").removesuffix("_exps")


@pytest.mark.parametrize("case", CASES)
def test_gguf_py_reads_every_expert_type_back_finite(models: dict[str, Path], case: str) -> None:
    want = CASES[case][2]
    seen = {}
    for t in GGUFReader(models[case]).tensors:
        key = expert_role(t.name)
        if key is None:
            continue
        seen[key] = t.tensor_type
        values = quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 0.5, t.name
    assert seen == want


def test_mix_errors_are_one_line() -> None:
    for mix, needle in (("down", "KEY=TYPE"), ("side=Q4_K", "neither a role"), ("2-1=Q4_K", "neither a role"),
                        ("down=IQ9", "unknown ggml type")):
        with pytest.raises(ExpertpackError, match=needle):
            plan_synth(SynthOptions(preset="tiny", expert_mix=mix))


@pytest.mark.parametrize("case", ["IQ1_S-dynamic"])
def test_mixed_model_packs_verifies_and_inspect_shows_each_mix(models: dict[str, Path], case: str,
                                                                tmp_path: Path) -> None:
    from expertpack.packtools.build import BuildOptions, build_pack
    from expertpack.packtools.inspect_pack import render_text, summarize
    from expertpack.packtools.verify import verify_pack

    build_pack(models[case], tmp_path / "pack", BuildOptions(progress=False, safety_margin_bytes=0))
    report = verify_pack(tmp_path / "pack", threads=1, progress=False)
    assert report.ok and report.blocks_checked == N_LAYER * 16, (report.problems, report.damaged)
    d = summarize(tmp_path / "pack").to_dict([1.0])
    assert [(g["layers"], [(r["role"], r["ggml_type"]) for r in g["roles"]]) for g in d["roles"]] == [
        ([0], [("gate", "IQ3_XXS"), ("up", "IQ3_XXS"), ("down", "IQ3_XXS")]),
        ([1], [("gate", "IQ1_S"), ("up", "IQ1_S"), ("down", "IQ2_XXS")])]
    blocks = 256 * 256 // 256  # of one role of one expert; IQ1_S 50 B a block, IQ2_XXS 66 B
    assert [r["nbytes"] for r in d["roles"][1]["roles"]] == [blocks * 50, blocks * 50, blocks * 66]
    text = render_text(d)
    assert "layers 0: gate,up,down IQ3_XXS;" in text and "layers 1: gate,up IQ1_S  down IQ2_XXS;" in text


@pytest.mark.parametrize("case", ["IQ2_XXS", "IQ1_S-dynamic"])
def test_cpu_logits_equal_gguf_py_dequantized_reference(models: dict[str, Path], case: str, tmp_path: Path) -> None:
    from expertpack.worker.engine.engine import Engine

    tokens = np.random.default_rng(2).integers(0, 2048, 12).tolist()

    def logits(path: Path) -> torch.Tensor:
        engine = Engine.load(path, "cpu")
        return engine.forward(tokens, engine.new_sequence()).float()

    got = logits(models[case])
    want = logits(float_copy(models[case], tmp_path / "f32.gguf", lambda name, _: expert_role(name) is not None))
    assert torch.isfinite(got).all() and got.std() > 0.01
    diff = (got - want).abs()
    assert diff.max() < 1e-3 * want.abs().max(), f"max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got, logits(models[case])), "a second load gives the same logits"
