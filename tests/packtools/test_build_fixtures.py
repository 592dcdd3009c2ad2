"""Every real llama.cpp fixture (one file or split set) packs, and the pack says exactly what the
design promises: each expert's bytes are its slice of the source tensor, verbatim; the trunk holds
every other tensor and every metadata key unchanged; offsets follow the formula; alignment holds."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from expertpack.packtools.gguf_source import SPLIT_KEYS, open_source
from expertpack.packtools.layout import (
    ALIGNMENT, PACK_FILE, ROLE_ALIGNMENT, TRUNK_FILE, TRUNK_FINGERPRINT_KEY, ExpertKey, Manifest, PackHeader,
    layout_problems,
)
from expertpack.packtools.verify import verify_pack

from ..conftest import fixture_ggufs, fixture_id

EXPERT_NAME = re.compile(r"^blk\.\d+\.\w+_exps\.\w+$")
IDS = [fixture_id(p) for p in fixture_ggufs()]


@pytest.fixture(params=IDS)
def pack(request: pytest.FixtureRequest, fixture_packs: dict[str, tuple[Path, Path]]) -> tuple[Path, Path, Manifest]:
    src, out = fixture_packs[request.param]
    return src, out, Manifest.load(out)


def test_layout_contract_holds(pack: tuple[Path, Path, Manifest]) -> None:
    _, out, m = pack
    assert layout_problems(m) == []
    assert (out / PACK_FILE).stat().st_size == m.pack_size_bytes
    assert m.data_start % ALIGNMENT == 0
    for layer in m.layers:
        assert layer.offset % ALIGNMENT == 0 and layer.stride % ALIGNMENT == 0
        assert layer.payload_bytes <= layer.stride < layer.payload_bytes + ALIGNMENT
        for e in range(m.model.n_expert):
            assert m.block_offset(ExpertKey(layer.layer, e)) == layer.offset + e * layer.stride
        for role in layer.roles:
            assert role.offset % ROLE_ALIGNMENT == 0
    header = PackHeader.decode((out / PACK_FILE).read_bytes()[:ALIGNMENT], out)
    assert header.fingerprint == m.fingerprint == m.compute_fingerprint()


def test_every_expert_is_its_source_slice_verbatim(pack: tuple[Path, Path, Manifest]) -> None:
    src, out, m = pack
    source = open_source(src)
    by_name = {t.name: t for t in source.tensors}
    packed = np.fromfile(out / PACK_FILE, dtype=np.uint8)
    expert_tensors = {t.name for t in source.tensors if EXPERT_NAME.match(t.name) and t.shape[-1] == m.model.n_expert}
    seen = set()
    for layer in m.layers:
        covered = np.zeros(layer.stride, dtype=bool)
        for role in layer.roles:
            t = by_name[role.tensor]
            seen.add(t.name)
            assert role.ggml_type == t.type_name and tuple(role.shape) == t.shape[:-1]
            assert role.nbytes * m.model.n_expert == t.nbytes
            raw = np.fromfile(source.shards[t.shard].path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
            for e in range(m.model.n_expert):
                start = layer.block_offset(e) + role.offset
                got = packed[start:start + role.nbytes]
                want = raw[e * role.nbytes:(e + 1) * role.nbytes]
                assert np.array_equal(got, want), f"layer {layer.layer} expert {e} role {role.role} differs"
            covered[role.offset:role.offset + role.nbytes] = True
        for e in range(m.model.n_expert):  # every byte outside the roles is zero padding
            block = packed[layer.block_offset(e):layer.block_offset(e) + layer.stride]
            assert not block[~covered].any(), f"layer {layer.layer} expert {e}: non-zero padding"
    assert seen == expert_tensors, "every per-expert tensor is in the pack, nothing else is"


def test_trunk_holds_everything_else_unchanged(pack: tuple[Path, Path, Manifest]) -> None:
    src, out, m = pack
    source = open_source(src)
    trunk = GGUFReader(out / TRUNK_FILE)
    in_pack = {r.tensor for layer in m.layers for r in layer.roles}
    expected = [t for t in source.tensors if t.name not in in_pack]
    got = {t.name: t for t in trunk.tensors}
    assert sorted(got) == sorted(t.name for t in expected)
    for t in expected:
        g = got[t.name]
        assert g.tensor_type == t.ggml_type and tuple(int(d) for d in g.shape) == t.shape, t.name
        raw = np.fromfile(source.shards[t.shard].path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        assert np.array_equal(np.asarray(g.data).view(np.uint8).reshape(-1), raw), f"trunk tensor {t.name} differs"
    keys = {k: f.contents() for k, f in trunk.fields.items() if not k.startswith("GGUF.")}
    assert keys.pop(TRUNK_FINGERPRINT_KEY) == m.fingerprint
    want = {k: f.value for k, f in source.metadata.items()}
    assert keys == want
    # and every value keeps its exact wire type (UINT32 stays UINT32, an array keeps its item type)
    raw_source = GGUFReader(src)
    for k in want:
        assert list(trunk.fields[k].types) == list(raw_source.fields[k].types), k
    assert not any(k in keys for k in SPLIT_KEYS)


def test_verify_passes(pack: tuple[Path, Path, Manifest]) -> None:
    _, out, m = pack
    report = verify_pack(out, progress=False)
    assert report.ok, report
    assert report.blocks_checked == len(m.layers) * m.model.n_expert


def test_split_set_packs_the_same_bytes_as_the_single_file(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    _, single = fixture_packs["qwen3moe-a.Q4_K_M"]
    _, split = fixture_packs["qwen3moe-a.Q4_K_M-00001-of-00003"]
    a, b = Manifest.load(single), Manifest.load(split)
    assert [l.sha256 for l in a.layers] == [l.sha256 for l in b.layers]
    assert len(b.source_files) == 3
    data_a = (single / PACK_FILE).read_bytes()[a.data_start:]
    data_b = (split / PACK_FILE).read_bytes()[b.data_start:]
    assert data_a == data_b


def test_roles_follow_the_naming_convention(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    roles = {name: {r.role for r in Manifest.load(out).layers[0].roles} for name, (_, out) in fixture_packs.items()}
    assert roles["qwen3moe-a.BF16"] == {"gate", "up", "down"}
    assert roles["qwen35moe-a.Q4_K_M-fusedgateup"] == {"gate_up", "down"}
    assert roles["gptoss-a.MXFP4"] == {"gate", "up", "down", "gate.bias", "up.bias", "down.bias"}
    ds = Manifest.load(fixture_packs["deepseek3-a.BF16"][1])
    assert ds.model.moe_layers == (1, 2)  # layer 0 is dense and stays in the trunk


def test_roles_sit_in_source_order(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    """The block order is the order a sequential read meets the tensors (it lets the build hash in
    stream); the fixtures' converter writes mixtral's experts as gate, down, up."""
    layer = Manifest.load(fixture_packs["mixtral-a.F16"][1]).layers[0]
    assert [r.role for r in layer.roles] == ["gate", "down", "up"]
    assert [r.offset for r in layer.roles] == sorted(r.offset for r in layer.roles)


def test_trunk_keeps_shared_experts_routers_and_hash_tables(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    _, out = fixture_packs["dsv4-tiny.BF16"]
    names = set(Manifest.load(out).trunk.tensor_sha256)
    for kept in ("blk.0.ffn_gate_tid2eid.weight", "blk.0.ffn_gate_shexp.weight", "blk.2.exp_probs_b.bias",
                 "blk.3.ffn_gate_inp.weight", "blk.0.hc_attn_fn.weight", "blk.1.attn_compressor_kv.weight"):
        assert kept in names
    m = Manifest.load(out)
    assert m.model.arch == "deepseek4" and m.model.moe_layers == (0, 1, 2, 3)


def test_pack_files_are_only_readable_complete_files(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    _, out = fixture_packs["mixtral-a.Q2_K"]
    assert sorted(os.listdir(out)) == ["experts.pack", "manifest.json", "trunk.gguf"]
