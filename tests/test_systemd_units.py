"""The systemd units and their companions pass systemd's own checks: `systemd-analyze verify` on
expertd.service and expert-worker@.service (ExecStart pointed at this checkout's programs),
sysusers and tmpfiles applied to a scratch root. The units keep the directives the programs rely
on, the example configurations are what the programs read, and `systemd-analyze security
--offline=true` scores their exposure within the bounds below."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from .conftest import BIN, REPO

UNITS = REPO / "systemd"

# Highest `systemd-analyze security` exposure (0 safe .. 10 exposed) each unit may score. expertd
# needs a socket, /dev/shm and the pack; the worker also the GPUs and the network.
MAX_EXPOSURE = {"expertd.service": 1.5, "expert-worker@.service": 2.5}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: install Debian's systemd package (the Makefile's test setup does)"
    return path


def test_expertd_unit_verifies(tmp_path: Path) -> None:
    unit = (UNITS / "expertd.service").read_text()
    for needed in ("Type=notify", "LimitMEMLOCK=infinity", "RuntimeDirectory=expertpack", "NoNewPrivileges=yes",
                   "ExecStart=/opt/expertpack/.venv/bin/expertd ",
                   "ProtectSystem=strict", "ReadOnlyPaths=/var/lib/expertpack", "PrivateTmp=yes", "Restart=on-failure",
                   "WatchdogSec=", "User=expertpack", "--config /etc/expertpack/expertd.toml"):
        assert needed in unit, needed
    local = tmp_path / "expertd.service"
    local.write_text(unit.replace("/opt/expertpack/.venv/bin/expertd", str(BIN / "expertd")))
    proc = subprocess.run([tool("systemd-analyze"), "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def exposure(unit: Path) -> float:
    """The overall exposure `systemd-analyze security --offline=true` gives the unit file."""
    proc = subprocess.run([tool("systemd-analyze"), "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, cwd=unit.parent)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, f"no exposure level in: {proc.stdout[-2000:]} {proc.stderr}"
    return float(found.group(1))


def test_expertd_exposure_is_bounded(tmp_path: Path) -> None:
    unit = (UNITS / "expertd.service").read_text()
    for needed in ("ReadWritePaths=/dev/shm", "PrivateDevices=yes", "SystemCallFilter=@system-service",
                   "CapabilityBoundingSet=\n", "MemoryDenyWriteExecute=yes"):
        assert needed in unit, needed
    local = tmp_path / "expertd.service"
    local.write_text(unit.replace("/opt/expertpack/.venv/bin/expertd", str(BIN / "expertd")))
    score = exposure(local)
    assert score <= MAX_EXPOSURE["expertd.service"], f"expertd.service exposure {score}"


def test_worker_exposure_is_bounded_with_the_gpus_allowed(tmp_path: Path) -> None:
    unit = (UNITS / "expert-worker@.service").read_text()
    for needed in ("ReadWritePaths=/dev/shm", "DevicePolicy=closed", "DeviceAllow=/dev/nvidiactl rw",
                   "DeviceAllow=/dev/nvidia-uvm rw", "DeviceAllow=char-nvidia-frontend rw",
                   "SystemCallFilter=@system-service", "CapabilityBoundingSet=\n"):
        assert needed in unit, needed
    assert "PrivateDevices=yes" not in unit  # it would hide the GPUs
    local = tmp_path / "expert-worker@.service"
    local.write_text(unit.replace("/opt/expertpack/.venv/bin/expert-worker", str(BIN / "expert-worker")))
    instance = tmp_path / "expert-worker@demo.service"
    instance.symlink_to(local)
    score = exposure(instance)
    assert score <= MAX_EXPOSURE["expert-worker@.service"], f"expert-worker@.service exposure {score}"


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
