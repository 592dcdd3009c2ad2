"""Pack format 1.1's block crc32s in the manifest: written by the build, validated on load (a bad
value names its key), counted against n_expert by the one manifest check, optional for a 1.0 pack,
and checked by verify beside the sha256s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from expertpack.packtools.errors import ManifestError
from expertpack.packtools.layout import (
    FORMAT_MINOR_VERSION, MANIFEST_FILE, Manifest, fingerprint_of, manifest_problems,
)
from expertpack.packtools.verify import verify_pack


def manifest_data(pack: Path) -> dict:
    return json.loads((pack / MANIFEST_FILE).read_text())


def loaded(data: dict) -> Manifest:
    data["fingerprint"] = fingerprint_of(data)
    return Manifest.from_dict(data)


def test_the_build_writes_format_1_1(tiny_pack: Path) -> None:
    data = manifest_data(tiny_pack)
    assert data["version"] == 1 and data["minor_version"] == FORMAT_MINOR_VERSION == 1
    n_expert = data["model"]["n_expert"]
    for layer in data["layers"]:
        assert len(layer["crc32"]) == len(layer["sha256"]) == n_expert
        assert all(len(c) == 8 and int(c, 16) >= 0 for c in layer["crc32"])
    assert not manifest_problems(Manifest.load(tiny_pack))


def test_a_1_0_manifest_loads_without_crc32s(tiny_pack: Path) -> None:
    data = manifest_data(tiny_pack)
    del data["minor_version"]
    for layer in data["layers"]:
        del layer["crc32"]
    m = loaded(data)
    assert m.minor_version == 0 and not m.has_crc32 and not manifest_problems(m)


@pytest.mark.parametrize("bad", [[1, 2], ["xyz"], ["ABCDEF01"], "00000000"])
def test_a_malformed_crc32_is_refused_naming_the_key(tiny_pack: Path, bad) -> None:
    data = manifest_data(tiny_pack)
    data["layers"][0]["crc32"] = bad
    with pytest.raises(ManifestError, match=r"layers\[\]\.crc32"):
        loaded(data)


def test_crc32s_must_cover_every_expert_of_every_layer(tiny_pack: Path) -> None:
    data = manifest_data(tiny_pack)
    data["layers"][0]["crc32"] = data["layers"][0]["crc32"][:-1]
    del data["layers"][1]["crc32"]
    problems = manifest_problems(loaded(data))
    assert any("block crc32s for" in p for p in problems)
    assert "some layers have block crc32s and others not" in problems


def test_verify_reports_a_wrong_crc32_the_build_recorded(tiny_pack: Path, tmp_path: Path) -> None:
    """Bytes that match their sha256 but not their crc32: expertd would refuse them, so verify says so."""
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    data = manifest_data(pack)
    data["layers"][2]["crc32"][7] = f"{int(data['layers'][2]['crc32'][7], 16) ^ 1:08x}"
    data["fingerprint"] = fingerprint_of(data)
    (pack / MANIFEST_FILE).write_text(json.dumps(data))
    report = verify_pack(pack, progress=False)
    layer = data["layers"][2]["layer"]
    assert report.damaged == []
    assert any(p.startswith(f"layer {layer} expert 7: its bytes match their sha256 but have crc32") for p in report.problems)
