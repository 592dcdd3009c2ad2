"""The systemd units and their companions pass systemd's own checks: `systemd-analyze verify` on
expertd.service and expert-worker@.service (ExecStart pointed at this checkout's programs),
sysusers and tmpfiles applied to a scratch root. The units keep the directives the programs rely
on, and the example configurations are what the programs read."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .conftest import BIN, REPO

UNITS = REPO / "systemd"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: install Debian's systemd package (the Makefile's test setup does)"
    return path


def test_expertd_unit_verifies(tmp_path: Path) -> None:
    unit = (UNITS / "expertd.service").read_text()
    for needed in ("Type=notify", "LimitMEMLOCK=infinity", "RuntimeDirectory=expertpack", "NoNewPrivileges=yes",
                   "ProtectSystem=strict", "ReadOnlyPaths=/var/lib/expertpack", "PrivateTmp=yes", "Restart=on-failure",
                   "WatchdogSec=", "User=expertpack", "--config /etc/expertpack/expertd.toml"):
        assert needed in unit, needed
    local = tmp_path / "expertd.service"
    local.write_text(unit.replace("/opt/expertpack/.venv/bin/expertd", str(BIN / "expertd")))
    proc = subprocess.run([tool("systemd-analyze"), "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_sysusers_and_tmpfiles_apply_to_a_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run([tool("systemd-sysusers"), f"--root={tmp_path}", str(UNITS / "expertpack.sysusers")], check=True)
    assert "expertpack:" in (tmp_path / "etc" / "passwd").read_text()
    subprocess.run([tool("systemd-tmpfiles"), f"--root={tmp_path}", "--create", str(UNITS / "expertpack.tmpfiles")],
                   check=True)
    assert (tmp_path / "var" / "lib" / "expertpack").is_dir()


def test_example_config_is_what_expertd_reads(tmp_path: Path) -> None:
    """The shipped expertd.toml parses with the daemon's own loader; only its pack path is made up."""
    text = (UNITS / "expertd.toml").read_text()
    proc = subprocess.run([str(BIN / "expertd"), "--config", str(UNITS / "expertd.toml")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "deepseek-v4-flash.expertpack" in proc.stderr, proc.stderr
    assert "unknown key" not in proc.stderr and "expected" not in proc.stderr
    assert 'pack = "/var/lib/expertpack/' in text


def test_worker_unit_verifies(tmp_path: Path) -> None:
    unit = (UNITS / "expert-worker@.service").read_text()
    for needed in ("After=expertd.service", "LimitMEMLOCK=infinity", "User=expertpack", "Restart=on-failure",
                   "--config /etc/expertpack/worker-%i.toml", "ReadOnlyPaths=/var/lib/expertpack"):
        assert needed in unit, needed
    local = tmp_path / "expert-worker@.service"
    local.write_text(unit.replace("/opt/expertpack/.venv/bin/expert-worker", str(BIN / "expert-worker")))
    instance = tmp_path / "expert-worker@demo.service"
    instance.symlink_to(local)
    proc = subprocess.run([tool("systemd-analyze"), "verify", str(instance)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_example_worker_config_is_what_expert_worker_reads() -> None:
    """Every key of the shipped worker.toml is known; it fails only on its made-up pack path."""
    proc = subprocess.run([str(BIN / "expert-worker"), "--config", str(UNITS / "worker.toml"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "deepseek-v4-flash.expertpack" in proc.stderr, proc.stderr
    assert "unknown keys" not in proc.stderr and "Traceback" not in proc.stderr
