"""`expertpack synth --pack OUT` writes exactly what `synth -o NAME.gguf` and then `build NAME.gguf -o
OUT` write (experts.pack, manifest.json and trunk.gguf, byte for byte), without the GGUF ever being
on disk, in memory that does not grow with the model; it follows build's rules for OUT (refuse a
finished pack without --force, resume a killed run), and a bad command line writes nothing."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from expertpack.packtools import build as build_module
from expertpack.packtools.build import BuildOptions, build_pack
from expertpack.packtools.build_plan import plan_build
from expertpack.packtools.build_state import STATE_FILE, load_state
from expertpack.packtools.layout import MANIFEST_FILE, PACK_FILE, TRUNK_FILE
from expertpack.packtools.source_pass import CHUNK_BYTES
from expertpack.packtools.synth import stream
from expertpack.packtools.synth.presets import PRESETS
from expertpack.packtools.synth.stream import source_name, synth_source
from expertpack.packtools.synth.writer import SynthOptions, plan_synth, write_synth
from expertpack.packtools.verify import verify_pack

from ..conftest import run_cli

OUTPUTS = (PACK_FILE, MANIFEST_FILE, TRUNK_FILE)
QUIET = BuildOptions(progress=False, safety_margin_bytes=0)


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """One created_utc for every build, so that two manifests can be compared byte for byte (the
    only key that differs between two builds of the same source, and outside the fingerprint)."""

    class Fixed(datetime):
        @classmethod
        def now(cls, tz: object = None) -> datetime:
            return datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)

    monkeypatch.setattr(build_module, "datetime", Fixed)


@pytest.fixture
def narrow_dsv4(monkeypatch: pytest.MonkeyPatch) -> None:
    """deepseek-v4-flash at small widths: its architecture (hyper-connections, CSA and HCA layers,
    hash-routed layers with their tid2eid tables) and types (MXFP4 experts, Q8_0 trunk), 6.5 MB
    at 4 layers instead of 8 GB at 2, so that the fast tests cover it; the slow test below runs
    the real shapes."""
    real = PRESETS["deepseek-v4-flash"]
    narrow = {"embedding_length": 256, "embedding_length_out": 1024, "attention.head_count": 4,
              "attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 32,
              "attention.q_lora_rank": 64, "attention.output_group_count": 2, "attention.output_lora_rank": 64,
              "attention.indexer.head_count": 4, "attention.indexer.key_length": 32,
              "expert_feed_forward_length": 128, "expert_count": 16}
    monkeypatch.setitem(PRESETS, "deepseek-v4-flash", dataclasses.replace(real, n_vocab=2048,
                                                                          meta={**real.meta, **narrow}))


def written_then_built(tmp_path: Path, options: SynthOptions, name: str) -> Path:
    """The reference: the GGUF written by write_synth, then built with build's defaults."""
    paths = write_synth(tmp_path / "gguf" / name, options)
    out = tmp_path / "built"
    build_pack(paths[0], out, QUIET)
    return out


def assert_same_outputs(a: Path, b: Path) -> None:
    """The three files of two packs are equal byte for byte; else where the first difference is."""
    for name in OUTPUTS:
        with open(a / name, "rb") as x, open(b / name, "rb") as y:
            at = 0
            while True:
                p, q = x.read(16 << 20), y.read(16 << 20)
                if p != q:
                    first = next((i for i, (u, v) in enumerate(zip(p, q)) if u != v), min(len(p), len(q)))
                    raise AssertionError(f"{name} differs at byte {at + first} (sizes {(a / name).stat().st_size} "
                                         f"and {(b / name).stat().st_size})")
                if not p:
                    break
                at += len(p)


CASES = {
    "tiny": SynthOptions(preset="tiny", progress=False),
    "tiny-split-skew-mix": SynthOptions(preset="tiny", shards=3, seed=5, routing_skew=0.7,
                                        expert_mix="down=Q6_K,1=Q8_0", trunk_type="Q4_K", progress=False),
    "deepseek-v4-flash-narrow": SynthOptions(preset="deepseek-v4-flash", n_layer=4, routing_skew=0.5, seed=9,
                                             progress=False),
    "deepseek-v4-flash-narrow-split": SynthOptions(preset="deepseek-v4-flash", n_layer=3, shards=4,
                                                   expert_type="Q8_0", progress=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pack_equals_the_build_of_the_written_gguf(case: str, tmp_path: Path, frozen_clock: None,
                                                   narrow_dsv4: None) -> None:
    options = CASES[case]
    out = tmp_path / "direct" / "model.expertpack"
    manifest = build_pack(synth_source(options, source_name(out)), out, QUIET)
    assert_same_outputs(written_then_built(tmp_path, options, "model.gguf"), out)
    assert sorted(p.name for p in out.parent.rglob("*")) == sorted(["model.expertpack", *OUTPUTS]), \
        "nothing but the pack: no GGUF, no partial file, no build state"
    assert [f.name for f in manifest.source_files] == \
        (["model.gguf"] if options.shards == 1 else [f"model-{i:05d}-of-{options.shards:05d}.gguf"
                                                      for i in range(1, options.shards + 1)])
    report = verify_pack(out, progress=False)
    assert report.ok, (report.problems, report.damaged)
    if options.preset == "deepseek-v4-flash":  # the architecture's parts are there to be copied
        names = {t.spec.name for t in plan_synth(options).tensors}
        assert "blk.0.ffn_gate_tid2eid.weight" in names and "blk.2.attn_compressor_kv.weight" in names


def test_cli_pack_equals_cli_synth_then_build_and_verifies(tmp_path: Path) -> None:
    flags = ("--preset", "tiny", "--layers", "3", "--seed", "4", "--routing-skew", "0.3")
    direct = tmp_path / "tiny3.expertpack"
    proc = run_cli("synth", *flags, "--pack", direct, check=True)
    assert proc.stdout.startswith(f"{direct}  fingerprint ")
    assert "straight into a pack" in proc.stderr and "copy" in proc.stderr  # the log line and build's progress
    run_cli("synth", *flags, "-o", tmp_path / "gguf" / "tiny3.gguf", "-q", check=True)
    built = run_cli("build", tmp_path / "gguf" / "tiny3.gguf", "-q", check=True)  # default out: tiny3.expertpack
    assert built.stdout.split()[-1] == proc.stdout.split()[-1], "the same fingerprint"
    for name in (PACK_FILE, TRUNK_FILE):
        assert (direct / name).read_bytes() == (tmp_path / "gguf" / "tiny3.expertpack" / name).read_bytes(), name
    a, b = (json.loads((d / MANIFEST_FILE).read_text()) for d in (direct, tmp_path / "gguf" / "tiny3.expertpack"))
    assert a.pop("created_utc") and b.pop("created_utc")
    assert a == b
    assert run_cli("verify", direct).returncode == 0
    assert not list(tmp_path.glob("*.gguf"))


def test_help_explains_pack() -> None:
    text = " ".join(run_cli("synth", "--help", check=True).stdout.split())
    assert "[-o OUT | --pack OUT]" in text
    assert "--pack OUT write experts.pack, manifest.json and trunk.gguf into the directory OUT" in text
    assert "No GGUF is written" in text


@pytest.mark.parametrize("where,needle", [
    (("-o", "x.gguf", "--pack", "out"), "argument --pack: not allowed with argument -o/--out"),
    ((), "either -o FILE.gguf or --pack OUT"),
    (("--pack", "out", "--type", "Q8_K"), "cannot write Q8_K"),
    (("--pack", "out", "--layers", "99"), "--layers must be between 1 and 4"),
    (("--pack", "out", "--shards", "999"), "--shards must be between 1 and the tensor count"),
    (("--pack", "out", "--safety-margin-gib", "1000000"), "not enough free space"),  # build's disk check
])
def test_bad_command_lines_write_nothing(tmp_path: Path, where: tuple[str, ...], needle: str) -> None:
    args = [tmp_path / a if a in ("x.gguf", "out") else a for a in where]
    proc = run_cli("synth", "--preset", "tiny", *args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].count(needle) == 1
    assert not list(tmp_path.iterdir())


def test_a_finished_pack_is_replaced_only_with_force_as_build_does(tmp_path: Path) -> None:
    out = tmp_path / "tiny.expertpack"
    run_cli("synth", "--preset", "tiny", "--pack", out, "-q", check=True)
    before = {n: (out / n).read_bytes() for n in OUTPUTS}
    proc = run_cli("synth", "--preset", "tiny", "--seed", "1", "--pack", out, "-q")
    assert proc.returncode == 2 and "already holds" in proc.stderr and "--force" in proc.stderr
    assert {n: (out / n).read_bytes() for n in OUTPUTS} == before
    run_cli("synth", "--preset", "tiny", "-o", tmp_path / "tiny.gguf", "-q", check=True)
    built = run_cli("build", tmp_path / "tiny.gguf", "-o", out, "-q")
    assert built.returncode == 2 and built.stderr.split(": ", 1)[1] == proc.stderr.split(": ", 1)[1]
    run_cli("synth", "--preset", "tiny", "--seed", "1", "--pack", out, "--force", "-q", check=True)
    assert (out / PACK_FILE).read_bytes() != before[PACK_FILE]
    assert run_cli("verify", out, "-q").returncode == 0


def test_other_files_in_out_are_left_alone_as_build_leaves_them(tmp_path: Path) -> None:
    """build refuses only a directory holding a pack's own files; anything else in it stays."""
    out = tmp_path / "pack"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    run_cli("synth", "--preset", "tiny", "--pack", out, "-q", check=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, "notes.txt"])
    assert run_cli("verify", out, "-q").returncode == 0


def test_the_plan_id_follows_the_options_that_decide_the_bytes() -> None:
    """A killed run resumes only into the same model: same options and name, same plan id; another
    seed or name (the manifest records it), another id, so the rerun starts over."""
    base = SynthOptions(preset="tiny", progress=False)

    def plan_id(options: SynthOptions, name: str = "tiny.gguf") -> str:
        return plan_build(synth_source(options, name)).plan_id()

    assert plan_id(base) == plan_id(dataclasses.replace(base, progress=True, force=True))
    assert len({plan_id(base), plan_id(dataclasses.replace(base, seed=1)), plan_id(base, "other.gguf"),
                plan_id(dataclasses.replace(base, routing_skew=0.5))}) == 4


def test_a_killed_pack_resumes_to_the_same_bytes(tmp_path: Path, frozen_clock: None, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A run that dies reading shard 2 of 2 past its first chunk (the checkpoints after every tensor
    stand) is finished by a rerun: the model is made again up to the checkpoint, once, for the
    source digest, and the copy goes on from there. The result is the uninterrupted run's."""
    options = SynthOptions(preset="small", n_layer=2, shards=2, seed=3, progress=False)
    resumable = dataclasses.replace(QUIET, checkpoint_every_s=0.0)
    reference = tmp_path / "reference"
    build_pack(synth_source(options, "small.gguf"), reference, QUIET)

    out = tmp_path / "small.expertpack"
    dying = synth_source(options, "small.gguf")
    make = dying.model.read_into

    def read_into(shard: int, buf: memoryview, at: int, want: int) -> int:
        if shard == 1 and at >= CHUNK_BYTES:
            raise OSError(errno.EIO, "injected read error")
        return make(shard, buf, at, want)

    dying.model.read_into = read_into  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        build_pack(dying, out, resumable)
    state = load_state(out)
    assert state is not None and state.shard == 1 and 0 < state.position, state
    assert not (out / MANIFEST_FILE).exists()

    restarts = []
    real_restart = stream._ModelBytes._restart
    monkeypatch.setattr(stream._ModelBytes, "_restart", lambda self: (restarts.append(1), real_restart(self)))
    with caplog.at_level(logging.INFO, logger="expertpack.build"):
        build_pack(synth_source(options, "small.gguf"), out, resumable)
    assert "resuming the interrupted build" in caplog.text
    assert len(restarts) == 1, "made once for the digest of what was copied, then read on"
    assert not (out / STATE_FILE).exists()
    assert_same_outputs(reference, out)


def _peak_rss_kib(*args: str | Path) -> int:
    """Runs `expertpack ARGS` in a fresh interpreter; its peak resident memory."""
    code = ("import resource, sys; from expertpack.cli.main import main; rc = main(sys.argv[1:]); "
            "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split("peak")[-1])


def test_memory_does_not_grow_with_the_model(tmp_path: Path) -> None:
    """Peak memory of `synth --pack` for all 8 layers of `small` is that of 2 layers, though it makes
    3.3x the bytes: nothing holds more than a few chunks of the model."""
    sizes, peaks = {}, {}
    for layers in (2, 8):
        out = tmp_path / f"l{layers}"
        peaks[layers] = _peak_rss_kib("synth", "--preset", "small", "--layers", layers, "--pack", out, "-q")
        sizes[layers] = plan_synth(SynthOptions(preset="small", n_layer=layers)).total_bytes
        shutil.rmtree(out)
    assert sizes[8] - sizes[2] > 180 << 20
    assert peaks[8] - peaks[2] < 48 << 10, (peaks, sizes)  # KiB: far less than the 180 MiB more it made


@pytest.mark.slow
def test_deepseek_v4_flash_at_real_shapes(tmp_path: Path, frozen_clock: None) -> None:
    """The real preset's shapes and types, cut to fit a test (its first layer, hash-routed by a
    129,280-token tid2eid table; 8 of its 256 experts, each its real 13,369,344 B; the 1.1 GB of
    embedding and head whole): 1.4 GB, both ways, equal."""
    options = SynthOptions(preset="deepseek-v4-flash", n_layer=1, n_expert=8, progress=False)
    need = 3 * plan_synth(options).total_bytes + (1 << 30)
    if shutil.disk_usage(tmp_path).free < need:
        pytest.skip(f"needs {need / 1e9:.0f} GB free in {tmp_path}")
    out = tmp_path / "dsv4.expertpack"
    try:
        manifest = build_pack(synth_source(options, source_name(out)), out, QUIET)
        assert_same_outputs(written_then_built(tmp_path, options, "dsv4.gguf"), out)
        assert {l.payload_bytes for l in manifest.layers} == {13_369_344}
        assert verify_pack(out, progress=False).ok
    finally:  # 4 GB: never left behind in pytest's kept temporary folders
        for path in tmp_path.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
