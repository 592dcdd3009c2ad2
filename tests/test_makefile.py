"""`make system-tools` (run by `make test`) installs the Debian packages of the tools that are
missing and no others, never upgrades what is installed, and says it needs root when it is not
root. Run against stand-ins on PATH: the tools, `id` and a recording `apt-get`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO

TOOLS = ("systemd-analyze", "systemd-sysusers", "systemd-tmpfiles", "unshare", "fio", "strace")
MAKE = shutil.which("make")


def system_tools(tmp_path: Path, present: tuple[str, ...], uid: int) -> tuple[subprocess.CompletedProcess[str], str]:
    """`make system-tools` with only `present` of TOOLS on PATH; (the run, apt-get's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-get.calls"
    stubs = {**{t: "exit 0" for t in present}, "id": f"echo {uid}", "apt-get": f'echo "$*" >> "{calls}"'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    run = subprocess.run([MAKE, "-s", "-C", str(REPO), "system-tools"], capture_output=True, text=True,
                         env={"PATH": str(bin_dir)}, timeout=30)
    return run, calls.read_text() if calls.exists() else ""


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_nothing_missing_installs_nothing(tmp_path: Path) -> None:
    run, calls = system_tools(tmp_path, TOOLS, uid=0)
    assert run.returncode == 0 and calls == "" and run.stdout == run.stderr == "", run


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_only_the_missing_packages_are_installed_and_none_upgraded(tmp_path: Path) -> None:
    run, calls = system_tools(tmp_path, ("systemd-analyze", "systemd-sysusers", "unshare", "fio"), uid=0)
    assert run.returncode == 0, run
    assert calls.splitlines() == ["update -qq", "install -y -qq --no-upgrade systemd strace"], calls


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_without_root_it_says_what_to_install_and_installs_nothing(tmp_path: Path) -> None:
    run, calls = system_tools(tmp_path, TOOLS[:4], uid=1000)
    assert run.returncode != 0 and calls == "", run
    assert "needs root" in run.stderr and "sudo apt-get install --no-upgrade fio strace" in run.stderr, run.stderr
