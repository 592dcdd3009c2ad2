"""inspect gives the planning numbers, the same from a source GGUF (before building) as from the
pack, and they add up: routed bytes per token = top-k x block bytes summed over MoE layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertpack.packtools.layout import Manifest

from ..conftest import run_cli


def inspect_json(target: Path, *extra: str) -> dict:
    proc = run_cli("inspect", target, "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_source_and_pack_agree(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    src, out = fixture_packs["qwen3moe-a.Q4_K_M"]
    before, after = inspect_json(src), inspect_json(out)
    assert before["built"] is False and after["built"] is True
    for key in ("arch", "moe_layers", "n_expert", "n_expert_used", "roles", "expert_block_bytes",
                "pack_size_bytes", "routed_bytes_per_token", "cache_fit"):
        assert before[key] == after[key], key


def test_numbers_add_up(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    _, out = fixture_packs["deepseek3-a.Q2_K"]
    m = Manifest.load(out)
    d = inspect_json(out, "--vram-gib", "0.001", "--vram-gib", "1")
    assert d["moe_layers"] == [1, 2] and d["n_expert_used"] == 2
    assert d["routed_bytes_per_token"] == sum(2 * l.stride for l in m.layers)
    assert d["routed_payload_bytes_per_token"] == sum(2 * l.payload_bytes for l in m.layers)
    assert d["routed_experts_per_token"] == 4 and d["n_experts_total"] == 16
    assert d["trunk_size_bytes"] == (out / "trunk.gguf").stat().st_size
    small, big = d["cache_fit"]
    assert small["slots"] == (1 << 30) // 1000 // m.max_stride
    assert big["slots"] == (1 << 30) // m.max_stride and big["fraction_of_experts"] == 1.0


def test_flagship_deepseek4_reports_mxfp4_blocks(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    src, _ = fixture_packs["dsv4-tiny.BF16"]
    text = run_cli("inspect", src, check=True).stdout
    assert "deepseek4" in text and "MXFP4" in text and "per token at 0% cache hit" in text
    d = inspect_json(src)
    gate = d["roles"][0]["roles"][0]
    assert gate["role"] == "gate" and gate["ggml_type"] == "MXFP4" and gate["shape"] == [256, 512]
    assert gate["nbytes"] == 512 * 256 // 32 * 17


def test_kimi_k3_full_model_from_its_header(tmp_path: Path) -> None:
    """The whole 93-layer `synth --preset kimi-k3` planned from its GGUF header (a sparse file: inspect
    of a source reads only the header, and 1 TB of random weights is not for CI): 11,956,224 B per
    expert, 1,472 experts and 17.6 GB per token at 0% hit, the 985.57 GB pack of real-shapes.json."""
    import os

    from expertpack.packtools.gguf_stream import write_header
    from expertpack.packtools.synth.writer import SynthOptions, plan_synth

    plan = plan_synth(SynthOptions(preset="kimi-k3"))
    src = tmp_path / "k3.gguf"
    layout = write_header(src, plan.arch, plan.metadata, [t.info() for t in plan.tensors])
    os.truncate(src, layout.size_bytes)
    try:
        d = inspect_json(src)
        text = run_cli("inspect", src, check=True).stdout
    finally:
        src.unlink()
    assert d["expert_block_bytes"] == d["expert_payload_bytes"] == {"min": 11_956_224, "max": 11_956_224}
    assert d["moe_layers"] == list(range(1, 93)) and d["n_expert"] == 896 and d["n_expert_used"] == 16
    assert d["routed_experts_per_token"] == 1_472
    assert d["routed_bytes_per_token"] == 1_472 * 11_956_224 == pytest.approx(17.6e9, rel=3e-3)
    assert d["pack_size_bytes"] == pytest.approx(985.57e9, rel=1e-4)
    assert "11,956,224 B per block" in text and "1,472 experts" in text and "17,599,561,728 B" in text


def test_the_cache_fit_says_what_its_slots_hold(tiny_pack: Path) -> None:
    """A slot is one expert block: 1 GiB holds 9,709 slots of the tiny pack's 108 KiB, which means
    all of its 64 experts, not 9,709 of them."""
    from expertpack.packtools.inspect_pack import render_text, summarize

    d = summarize(tiny_pack).to_dict([0.001, 1.0])
    assert [(row["slots"], row["experts"]) for row in d["cache_fit"]] == [(9, 9), (9709, 64)]
    text = render_text(d)
    assert "expert cache fit (slots of 108.00 KiB, one expert block each):" in text, text
    assert "0.001 GiB          9 slots: 9 of the 64 experts (14.06%)" in text, text
    assert "1 GiB      9,709 slots: all 64 experts" in text, text
