"""verify finds damage and names it: one flipped byte in one expert block names exactly that
(layer, expert); a damaged trunk tensor, an edited manifest, a truncated pack are each reported; a
manifest whose layout breaks the contract is reported without reading a block."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from expertpack.packtools.layout import PACK_FILE, TRUNK_FILE, ExpertKey, Manifest, fingerprint_of
from expertpack.packtools.verify import verify_pack

from ..conftest import BIN, run_cli


@pytest.fixture
def pack_copy(tmp_path: Path, fixture_packs: dict[str, tuple[Path, Path]]) -> Path:
    out = tmp_path / "pack"
    shutil.copytree(fixture_packs["deepseek3-a.Q4_K_M"][1], out)
    return out


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("layer_index,expert,where", [(0, 0, "first"), (1, 5, "middle"), (1, 7, "last")])
def test_one_flipped_byte_names_exactly_that_expert(pack_copy: Path, layer_index: int, expert: int, where: str) -> None:
    m = Manifest.load(pack_copy)
    layer = m.layers[layer_index]
    offset = layer.block_offset(expert) + {"first": 0, "middle": layer.payload_bytes // 2,
                                            "last": layer.payload_bytes - 1}[where]
    flip(pack_copy / PACK_FILE, offset)
    report = verify_pack(pack_copy, progress=False)
    assert [d.key for d in report.damaged] == [ExpertKey(layer.layer, expert)]
    assert report.problems == []
    proc = run_cli("verify", pack_copy, "-q")
    assert proc.returncode == 1
    assert f"damaged: layer {layer.layer} expert {expert} " in proc.stdout
    assert proc.stdout.count("damaged:") == 1


def test_damaged_trunk_tensor_is_named(pack_copy: Path) -> None:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(pack_copy / TRUNK_FILE).tensors if t.name == "blk.0.attn_q_a.weight")
    offset = int(t.data_offset) + 10
    del t
    flip(pack_copy / TRUNK_FILE, offset)
    report = verify_pack(pack_copy, progress=False)
    assert report.damaged == []
    assert any("blk.0.attn_q_a.weight" in p for p in report.problems)


def test_edited_manifest_is_detected(pack_copy: Path) -> None:
    path = pack_copy / "manifest.json"
    data = json.loads(path.read_text())
    data["model"]["n_expert_used"] = 3
    path.write_text(json.dumps(data))
    report = verify_pack(pack_copy, progress=False)
    assert any("fingerprint" in p for p in report.problems)


def test_truncated_pack_is_detected(pack_copy: Path) -> None:
    path = pack_copy / PACK_FILE
    m = Manifest.load(pack_copy)
    with open(path, "r+b") as f:
        f.truncate(m.layers[-1].block_offset(6))
    report = verify_pack(pack_copy, progress=False)
    assert any("bytes, the manifest says" in p for p in report.problems)
    assert {d.key for d in report.damaged} == {ExpertKey(m.layers[-1].layer, 6), ExpertKey(m.layers[-1].layer, 7)}


def test_trunk_from_another_pack_is_detected(pack_copy: Path, fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    other = fixture_packs["deepseek3-a.Q2_K"][1]
    shutil.copy(other / TRUNK_FILE, pack_copy / TRUNK_FILE)
    report = verify_pack(pack_copy, progress=False)
    assert any("fingerprint" in p or "bytes, the manifest says" in p for p in report.problems)


def test_no_manifest_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("verify", tmp_path)
    assert proc.returncode == 2 and "no manifest" in proc.stderr


def test_a_read_error_names_the_block_instead_of_crashing(pack_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from expertpack.packtools import hashing

    m = Manifest.load(pack_copy)
    bad = m.layers[1].block_offset(3)
    real = os.pread

    def flaky_pread(fd: int, n: int, offset: int) -> bytes:
        if offset == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(hashing.os, "pread", flaky_pread)
    report = verify_pack(pack_copy, progress=False)
    assert [d.key for d in report.damaged] == [ExpertKey(m.layers[1].layer, 3)]
    assert "read error" in report.damaged[0].found


def test_a_manifest_whose_layers_repeat_is_reported_without_reading_a_block(pack_copy: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a manifest listing its layers 1,000 times (its fingerprint made to match) had verify
    read a 7 MB pack 1,000 times, 6.59 GB. The layout is checked before any block is read: it is
    reported, once per layer listed twice, and no block is hashed (50 times here)."""
    from expertpack.packtools import hashing

    path = pack_copy / "manifest.json"
    data = json.loads(path.read_text())
    n_layers = len(data["layers"])
    data["layers"] = data["layers"] * 50
    data["model"]["moe_layers"] = data["model"]["moe_layers"] * 50
    data["fingerprint"] = fingerprint_of(data)
    path.write_text(json.dumps(data))
    read: list[int] = []
    real = hashing.os.pread

    def counted_pread(fd: int, n: int, offset: int) -> bytes:
        data = real(fd, n, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(hashing.os, "pread", counted_pread)
    report = verify_pack(pack_copy, progress=False)
    assert report.blocks_checked == 0 and report.bytes_checked == 0 and not report.damaged
    assert not report.ok and any("listed 50 times" in p for p in report.problems), report.problems
    assert any("expert blocks not hashed" in p for p in report.problems), report.problems
    assert len(report.problems) <= n_layers + 4, report.problems  # not one line per repetition
    assert sum(read) <= (pack_copy / "trunk.gguf").stat().st_size  # the trunk's tensors, no expert block
    proc = run_cli("verify", pack_copy, "-q")
    assert proc.returncode == 1 and "expert blocks not hashed" in proc.stdout, proc.stdout


def test_a_key_added_to_the_manifest_is_detected(pack_copy: Path) -> None:
    path = pack_copy / "manifest.json"
    data = json.loads(path.read_text())
    data["model"]["note"] = "added by hand"
    path.write_text(json.dumps(data))
    assert any("fingerprint" in p for p in verify_pack(pack_copy, progress=False).problems)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["model"].__setitem__("moe_layers", ["x"]), "model.moe_layers"),
    (lambda d: d["trunk"].__setitem__("file", "../elsewhere.gguf"), "trunk.file"),
    (lambda d: d["layers"][0]["roles"][0].__setitem__("shape", [1.5]), "shape"),
])
def test_malformed_manifest_is_one_line(pack_copy: Path, edit, needle: str) -> None:
    path = pack_copy / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    for command in ("verify", "inspect"):
        proc = run_cli(command, pack_copy)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("refingerprint", [False, True])
def test_a_huge_expert_count_is_refused_by_verify_and_expertd_alike(pack_copy: Path, tmp_path: Path,
                                                                     refingerprint: bool) -> None:
    """n_expert = 10**12 (also in a manifest whose fingerprint was recomputed to match): verify
    reports it at once instead of looping over a trillion blocks, with the same words as expertd's
    refusal; both run the one manifest check."""
    path = pack_copy / "manifest.json"
    data = json.loads(path.read_text())
    data["model"]["n_expert"] = 10**12
    if refingerprint:
        data["fingerprint"] = fingerprint_of(data)
    path.write_text(json.dumps(data))
    proc = run_cli("verify", "--quiet", pack_copy, timeout=30)
    assert proc.returncode == 1, proc
    problems = [line.removeprefix("problem: ") for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    assert any("model.n_expert 1000000000000 is not in 1.." in p for p in problems), proc.stdout
    assert any("past the pack size" in p for p in problems), proc.stdout
    daemon = subprocess.run([str(BIN / "expertd"), "--pack", str(pack_copy), "--endpoint", f"ipc://{tmp_path}/s.sock"],
                            capture_output=True, text=True, timeout=30)
    assert daemon.returncode == 2 and "Traceback" not in daemon.stderr
    shared = [p for p in problems if "n_expert" in p or "past the pack size" in p or "modified" in p]
    assert len(shared) >= 2 + (not refingerprint)
    assert all(p in daemon.stderr for p in shared), (shared, daemon.stderr)
