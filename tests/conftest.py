"""Shared test fixtures: the real llama.cpp GGUFs in ../shared/fixtures (made by others; the outside
world), packs built from them once per session, and a helper to run the installed CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("EXPERTPACK_FIXTURES", REPO.parent / "shared" / "fixtures"))
BIN = Path(sys.executable).parent


def fixture_ggufs() -> list[Path]:
    """Every fixture model: single files and the first shard of each split set."""
    if not FIXTURES.is_dir():
        raise RuntimeError(f"shared fixtures not found at {FIXTURES}; set EXPERTPACK_FIXTURES")
    paths = sorted(p for p in FIXTURES.rglob("*.gguf") if "-of-" not in p.name or "-00001-of-" in p.name)
    assert len(paths) >= 10, f"expected the shared fixture GGUFs under {FIXTURES}, found {paths}"
    return paths


def fixture_id(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def run_cli(*args: str | Path, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the installed `expertpack` console script."""
    proc = subprocess.run([str(BIN / "expertpack"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"expertpack {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def fixture_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """fixture id -> (source GGUF, built pack directory), built once per session."""
    from expertpack.packtools.build import BuildOptions, build_pack

    root = tmp_path_factory.mktemp("fixture-packs")
    packs = {}
    for src in fixture_ggufs():
        out = root / fixture_id(src)
        build_pack(src, out, BuildOptions(progress=False, safety_margin_bytes=0))
        packs[fixture_id(src)] = (src, out)
    return packs


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from expertpack.packtools.synth.writer import SynthOptions, write_synth

    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_synth(path, SynthOptions(preset="tiny", progress=False))
    return path
