"""Bad input gets one clear line and a non-zero exit, and leaves nothing that passes verify:
truncated or non-GGUF files, missing or mismatched shards, dense models, unknown ggml types,
unclassifiable expert tensors, too little disk, an output already present."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from expertpack.packtools.errors import ClassifyError, DenseModelError, SourceError
from expertpack.packtools.experts import classify
from expertpack.packtools.gguf_source import open_source

from ..conftest import FIXTURES, run_cli

SPLIT_DIR = FIXTURES / "gguf" / "qwen3moe-a" / "split-Q4_K_M"
SINGLE = FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q2_K.gguf"


def write_gguf(path: Path, arch: str, kv: dict[str, int], tensors: dict[str, np.ndarray]) -> Path:
    w = GGUFWriter(path, arch)
    for k, v in kv.items():
        w.add_uint32(k, v)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def moe_tensors(n_layer: int = 1, n_expert: int = 4, h: int = 32, ff: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"token_embd.weight": rng.standard_normal((64, h), dtype=np.float32)}
    for i in range(n_layer):
        out[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((n_expert, h), dtype=np.float32)
        out[f"blk.{i}.ffn_gate_exps.weight"] = rng.standard_normal((n_expert, ff, h), dtype=np.float32)
        out[f"blk.{i}.ffn_up_exps.weight"] = rng.standard_normal((n_expert, ff, h), dtype=np.float32)
        out[f"blk.{i}.ffn_down_exps.weight"] = rng.standard_normal((n_expert, h, ff), dtype=np.float32)
    return out


def assert_fails_cleanly(src: Path, out: Path, *needles: str) -> None:
    proc = run_cli("build", src, "-o", out, "-q")
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert run_cli("verify", out, "-q").returncode != 0
    assert not (out / "manifest.json").exists()


def test_truncated_gguf(tmp_path: Path) -> None:
    src = tmp_path / "cut.gguf"
    src.write_bytes(SINGLE.read_bytes()[: SINGLE.stat().st_size // 2])
    assert_fails_cleanly(src, tmp_path / "out", "cut.gguf", "truncated")


@pytest.mark.parametrize("keep,needle", [
    (20_000, "truncated inside its GGUF header (the file ends at byte 20,000)"),
    (1_048_576, "truncated: its GGUF tensors end at byte"),
    (-100, "truncated: its GGUF tensors end at byte"),
])
def test_a_cut_gguf_says_it_is_cut_not_numpy(tmp_path: Path, keep: int, needle: str) -> None:
    data = SINGLE.read_bytes()
    src = tmp_path / "short.gguf"
    src.write_bytes(data[:keep])
    for command in ("build", "inspect"):
        proc = run_cli(command, src, *(("-o", tmp_path / "out", "-q") if command == "build" else ()))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert needle in lines[0] and "reshape" not in lines[0] and "dtype" not in lines[0], lines[0]


def test_header_cut_short(tmp_path: Path) -> None:
    src = tmp_path / "short.gguf"
    src.write_bytes(SINGLE.read_bytes()[:200])
    assert_fails_cleanly(src, tmp_path / "out", "short.gguf", "GGUF")


@pytest.mark.parametrize("content", [b"", b"definitely not a gguf file" * 100])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    src = tmp_path / "notes.gguf"
    src.write_bytes(content)
    assert_fails_cleanly(src, tmp_path / "out", "notes.gguf", "GGUF")


def test_missing_source(tmp_path: Path) -> None:
    assert_fails_cleanly(tmp_path / "nope.gguf", tmp_path / "out", "no such file")


def test_split_set_opens_from_its_first_shard() -> None:
    source = open_source(SPLIT_DIR / "qwen3moe-a.Q4_K_M-00001-of-00003.gguf")
    assert len(source.shards) == 3 and len(source.tensors) == 27
    assert source.arch == "qwen3moe"
    assert {t.shard for t in source.tensors} == {0, 1, 2}


def test_a_later_shard_is_refused(tmp_path: Path) -> None:
    assert_fails_cleanly(SPLIT_DIR / "qwen3moe-a.Q4_K_M-00002-of-00003.gguf", tmp_path / "out",
                         "shard 2 of 3", "first shard")


def test_missing_shard(tmp_path: Path) -> None:
    for name in ("qwen3moe-a.Q4_K_M-00001-of-00003.gguf", "qwen3moe-a.Q4_K_M-00003-of-00003.gguf"):
        shutil.copy(SPLIT_DIR / name, tmp_path / name)
    assert_fails_cleanly(tmp_path / "qwen3moe-a.Q4_K_M-00001-of-00003.gguf", tmp_path / "out",
                         "incomplete", "00002-of-00003")


def test_shards_of_two_models_are_refused(tmp_path: Path) -> None:
    """The middle shard comes from a different split set (another model) under the expected name."""
    for name in ("qwen3moe-a.Q4_K_M-00001-of-00003.gguf", "qwen3moe-a.Q4_K_M-00003-of-00003.gguf"):
        shutil.copy(SPLIT_DIR / name, tmp_path / name)
    run_cli("synth", "--preset", "tiny", "--shards", "3", "-o", tmp_path / "other.gguf", "-q", check=True)
    shutil.copy(tmp_path / "other-00002-of-00003.gguf", tmp_path / "qwen3moe-a.Q4_K_M-00002-of-00003.gguf")
    assert_fails_cleanly(tmp_path / "qwen3moe-a.Q4_K_M-00001-of-00003.gguf", tmp_path / "out",
                         "00002-of-00003", "different model")


def test_shards_out_of_order_are_refused(tmp_path: Path) -> None:
    shutil.copy(SPLIT_DIR / "qwen3moe-a.Q4_K_M-00001-of-00003.gguf", tmp_path / "m-00001-of-00003.gguf")
    shutil.copy(SPLIT_DIR / "qwen3moe-a.Q4_K_M-00003-of-00003.gguf", tmp_path / "m-00002-of-00003.gguf")
    shutil.copy(SPLIT_DIR / "qwen3moe-a.Q4_K_M-00002-of-00003.gguf", tmp_path / "m-00003-of-00003.gguf")
    assert_fails_cleanly(tmp_path / "m-00001-of-00003.gguf", tmp_path / "out", "m-00002-of-00003",
                         "shard 3 of 3, expected shard 2")


def test_dense_model_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = write_gguf(tmp_path / "dense.gguf", "llama", {"llama.block_count": 1}, {
        "token_embd.weight": rng.standard_normal((64, 32), dtype=np.float32),
        "blk.0.ffn_gate.weight": rng.standard_normal((64, 32), dtype=np.float32),
    })
    with pytest.raises(DenseModelError):
        classify(open_source(src))
    assert_fails_cleanly(src, tmp_path / "out", "dense", "MoE models only")


def test_expert_tensor_with_wrong_expert_dimension_is_refused(tmp_path: Path) -> None:
    tensors = moe_tensors(n_expert=4)
    tensors["blk.0.ffn_up_exps.weight"] = np.zeros((3, 32, 32), dtype=np.float32)  # 3 != expert_count 4
    src = write_gguf(tmp_path / "odd.gguf", "qwen3moe", {"qwen3moe.block_count": 1, "qwen3moe.expert_count": 4,
                                                         "qwen3moe.expert_used_count": 2}, tensors)
    with pytest.raises(ClassifyError, match="outermost dimension is 3"):
        classify(open_source(src))


def test_legacy_per_expert_tensors_are_refused(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.zeros((64, 32), dtype=np.float32),
               "blk.0.ffn_gate.0.weight": np.zeros((32, 32), dtype=np.float32)}
    src = write_gguf(tmp_path / "legacy.gguf", "llama", {"llama.block_count": 1, "llama.expert_count": 4,
                                                         "llama.expert_used_count": 2}, tensors)
    with pytest.raises(ClassifyError, match="legacy"):
        classify(open_source(src))


def test_missing_expert_count_is_refused(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "nocount.gguf", "qwen3moe", {"qwen3moe.block_count": 1}, moe_tensors())
    assert_fails_cleanly(src, tmp_path / "out", "qwen3moe.expert_count")


def test_one_value_per_layer_exps_tensor_stays_in_trunk(tmp_path: Path) -> None:
    """Arctic's blk.N.ffn_norm_exps.weight is a shared norm despite its name."""
    tensors = moe_tensors(n_expert=4, h=32)
    tensors["blk.0.ffn_norm_exps.weight"] = np.ones(32, dtype=np.float32)
    src = write_gguf(tmp_path / "arctic.gguf", "arctic", {"arctic.block_count": 1, "arctic.expert_count": 4,
                                                          "arctic.expert_used_count": 2}, tensors)
    cls = classify(open_source(src))
    assert "blk.0.ffn_norm_exps.weight" in {t.name for t in cls.trunk}
    assert [e.role for e in cls.experts] == ["gate", "up", "down"]


def test_unknown_ggml_type(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "weird.gguf", "qwen3moe", {"qwen3moe.block_count": 1, "qwen3moe.expert_count": 4,
                                                           "qwen3moe.expert_used_count": 2}, moe_tensors())
    raw = bytearray(src.read_bytes())
    name = b"blk.0.ffn_up_exps.weight"
    at = raw.index(name) + len(name)  # tensor info: name, n_dims u32, dims u64 x n, type u32, offset u64
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == GGMLQuantizationType.F32
    raw[type_at:type_at + 4] = (97).to_bytes(4, "little")
    src.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="unknown ggml type"):
        open_source(src)
    assert_fails_cleanly(src, tmp_path / "out", "weird.gguf", "unknown ggml type")


def test_not_enough_disk(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("build", SINGLE, "-o", out, "-q", "--safety-margin-gib", "1000000")
    assert proc.returncode == 2
    assert "not enough free space" in proc.stderr and "--safety-margin-gib" in proc.stderr
    assert run_cli("verify", out, "-q").returncode != 0
    assert not out.exists(), list(out.iterdir())  # no trunk.gguf.partial, no experts.pack.partial, no folder


def test_not_enough_disk_in_an_existing_folder_leaves_it_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli("build", SINGLE, "-o", out, "-q", "--safety-margin-gib", "1000000")
    assert proc.returncode == 2 and "not enough free space" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_present_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_cli("build", SINGLE, "-o", out, "-q", check=True)
    before = (out / "manifest.json").read_text()
    proc = run_cli("build", SINGLE, "-o", out, "-q")
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert (out / "manifest.json").read_text() == before  # the finished pack is untouched
    run_cli("build", SINGLE, "-o", out, "-q", "--force", check=True)
    assert run_cli("verify", out, "-q").returncode == 0


def test_a_trunk_is_not_a_source(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_cli("build", SINGLE, "-o", out, "-q", check=True)
    assert_fails_cleanly(out / "trunk.gguf", tmp_path / "again", "trunk.gguf of an expert pack")


def test_empty_metadata_array_is_dropped_with_a_warning(tmp_path: Path) -> None:
    """gguf-py reads an empty array but cannot write one: the trunk omits it and says so."""
    w = GGUFWriter(tmp_path / "e.gguf", "qwen3moe")
    for k, v in {"qwen3moe.block_count": 1, "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2}.items():
        w.add_uint32(k, v)
    w.add_array("test.empty", [7])  # one UINT32 item: patched to an empty array below
    w.add_string("test.pad", "abcd")  # takes back the 4 bytes the item loses, so no offset moves
    for name, data in moe_tensors().items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = bytearray((tmp_path / "e.gguf").read_bytes())
    key = b"test.empty"
    at = raw.index(key) + len(key) + 4 + 4  # value type ARRAY, item type
    assert int.from_bytes(raw[at:at + 8], "little") == 1
    raw[at:at + 8] = (0).to_bytes(8, "little")
    del raw[at + 8:at + 12]
    pad = raw.index(b"\x04\x00\x00\x00\x00\x00\x00\x00abcd")
    raw[pad:pad + 12] = (8).to_bytes(8, "little") + b"abcdefgh"
    (tmp_path / "e.gguf").write_bytes(bytes(raw))
    assert open_source(tmp_path / "e.gguf").metadata["test.empty"].value == []
    proc = run_cli("build", tmp_path / "e.gguf", "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "test.empty is an empty array" in proc.stderr
    assert run_cli("verify", tmp_path / "out", "-q").returncode == 0


def test_unwritable_output_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("build", SINGLE, "-o", "/proc/expertpack-out", "-q")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_source_that_cannot_be_read_fails_instead_of_hanging(tmp_path: Path) -> None:
    import hashlib

    from expertpack.packtools.source_pass import FileReader, read_chunks

    with pytest.raises(FileNotFoundError):
        for _ in read_chunks(FileReader(tmp_path / "gone.gguf"), 0, 1 << 20, hashlib.sha256()):
            pass

    class Failing:  # a reader whose read fails in the pipeline's reader thread
        name, alignment = "failing", 1

        def read_into(self, buf: memoryview, at: int, want: int) -> int:
            raise OSError(5, "Input/output error")

        def close(self) -> None:
            pass

    with pytest.raises(OSError, match="Input/output error"):
        for _ in read_chunks(Failing(), 0, 1 << 20, hashlib.sha256()):
            pass


@pytest.mark.parametrize("args,needle", [
    (("build", SINGLE, "--safety-margin-gib", "nan"), "--safety-margin-gib"),
    (("build", SINGLE, "--safety-margin-gib", "inf"), "--safety-margin-gib"),
    (("build", SINGLE, "--safety-margin-gib", "-1"), "--safety-margin-gib"),
    (("build", SINGLE, "--checkpoint-every-s", "-1"), "--checkpoint-every-s"),
    (("build", SINGLE, "--threads", "0"), "--threads"),
    (("inspect", SINGLE, "--vram-gib", "-8"), "--vram-gib"),
    (("eval", SINGLE, "--text", "hi", "--top-p", "nan"), "--top-p"),
    (("eval", SINGLE, "--text", "hi", "--device", "bogus"), "--device 'bogus'"),
    (("synth", "--preset", "tiny", "-o", "x.gguf", "--shards", "0"), "--shards"),
])
def test_numeric_flags_out_of_range_are_one_line(tmp_path: Path, args: tuple, needle: str) -> None:
    out = tmp_path / "out"
    args = tuple(tmp_path / a if a == "x.gguf" else a for a in args)
    proc = run_cli(*args, *(("-o", out) if args[0] == "build" else ()))
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and needle in lines[0], lines
    assert not out.exists() and not (tmp_path / "x.gguf").exists()
