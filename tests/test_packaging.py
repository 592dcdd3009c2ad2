"""The project installs as the expertpack.* namespace only, editable and as a wheel, and the
offline tools never import torch (they must start in milliseconds)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import expertpack.packtools

from .conftest import BIN, REPO

CODE_DIRS = ("packtools", "daemon", "client", "worker", "bench", "cli")


def test_editable_install_maps_the_namespace_onto_the_repo(tmp_path: Path) -> None:
    assert Path(expertpack.packtools.__file__).resolve() == REPO / "packtools" / "__init__.py"
    # In a fresh interpreter outside the repo (pytest itself puts the repo root on sys.path).
    code = ("import importlib.util as u, sys; names = sys.argv[1:]; "
            "assert all(u.find_spec('expertpack.' + n) for n in names); "
            "print([n for n in names if u.find_spec(n) is not None])")
    proc = subprocess.run([sys.executable, "-c", code, *CODE_DIRS], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"bare modules importable: {proc.stdout}"


def test_console_script_runs() -> None:
    proc = subprocess.run([str(BIN / "expertpack"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for command in ("build", "verify", "inspect", "synth"):
        assert command in proc.stdout
        sub = subprocess.run([str(BIN / "expertpack"), command, "--help"], capture_output=True, text=True)
        assert sub.returncode == 0 and "usage: expertpack " + command in sub.stdout


def test_offline_tools_do_not_import_torch() -> None:
    code = ("import sys, expertpack.cli.main, expertpack.packtools.build, expertpack.packtools.verify, "
            "expertpack.packtools.inspect_pack, expertpack.packtools.synth.writer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_wheel_holds_only_the_namespace_and_works(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(REPO)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("expertpack-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"expertpack", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    for name in CODE_DIRS:  # every package and subpackage of the source tree, every module
        for path in (REPO / name).rglob("*.py"):
            assert f"expertpack/{name}/{path.relative_to(REPO / name)}" in names, f"{path} is not in the wheel"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "expertpack = expertpack.cli.main:main" in entry_points
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # -S: no site processing, so the editable install's finder is absent and only the wheel is seen.
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import expertpack.cli.main as c; "
            "print(c.__file__); sys.exit(c.main(['synth', '--list']))")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(target), site_packages], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith(str(target)) and "deepseek-v4-flash" in proc.stdout
