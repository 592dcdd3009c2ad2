"""expertd refuses to serve what it cannot serve safely, before it says READY, with one clear line
and a non-zero exit: a pack on a filesystem without O_DIRECT (ramfs; tmpfs takes O_DIRECT since
Linux 6.6), a misaligned layout, a manifest that belongs to another pack, a bad configuration.
`direct_io = false` is the only way to buffered reads, and then fallback_count says so."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from expertpack.client import ExpertClient
from expertpack.packtools.layout import MANIFEST_FILE, Manifest, fingerprint_of

from ..conftest import BIN, start_daemon


def run_expertd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "expertd"), *args], capture_output=True, text=True, timeout=timeout)


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_pack_without_o_direct_is_refused(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path, on_ramfs=True)
    d.proc.wait(timeout=30)
    code, log = d.stop()
    assert code == 2, log
    assert "refuses O_DIRECT" in log and "direct_io = false" in log and "Traceback" not in log
    assert not d.notes, "READY must not be sent"
    assert not d.socket_path.exists()


def test_buffered_reads_only_when_asked_and_counted(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path, "--no-direct-io", on_ramfs=True)
    d.wait_for("READY=1")
    try:
        with ExpertClient(d.endpoint) as client:
            for expert in client.fetch([(0, 0), (1, 3)]):
                expert.release()
            stats = client.stats()
        assert stats["direct_io"] is False
        assert stats["counters"]["fallback_count"] == stats["counters"]["read_ops"] > 0
    finally:
        assert d.stop()[0] == 0


def rewrite_manifest(pack: Path, edit) -> None:
    data = json.loads((pack / MANIFEST_FILE).read_text())
    edit(data)
    data["fingerprint"] = fingerprint_of(data)  # a self-consistent manifest: only the contract is wrong
    (pack / MANIFEST_FILE).write_text(json.dumps(data))


def test_misaligned_layout_is_refused(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)

    def shift(data: dict) -> None:
        data["layers"][1]["offset"] += 512

    rewrite_manifest(pack, shift)
    assert_refused(run_expertd("--pack", str(pack), "--endpoint", f"ipc://{tmp_path}/s.sock"),
                   "layout contract", "layer 1: offset", "not a multiple of 4096")


def test_manifest_of_another_pack_is_refused(tiny_pack: Path, fixture_packs: dict, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    other = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    shutil.copy(other / MANIFEST_FILE, pack / MANIFEST_FILE)
    assert_refused(run_expertd("--pack", str(pack), "--endpoint", f"ipc://{tmp_path}/s.sock"), "do not belong together")


def test_header_of_another_build_is_refused(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)

    def rename_source(data: dict) -> None:
        data["source"]["files"][0]["name"] = "other.gguf"  # same layout, different fingerprint

    rewrite_manifest(pack, rename_source)
    assert Manifest.load(pack).fingerprint != Manifest.load(tiny_pack).fingerprint
    assert_refused(run_expertd("--pack", str(pack), "--endpoint", f"ipc://{tmp_path}/s.sock"),
                   "header", "does not match manifest.json")


def test_edited_manifest_is_refused(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    data = json.loads((pack / MANIFEST_FILE).read_text())
    data["model"]["n_expert_used"] += 1
    (pack / MANIFEST_FILE).write_text(json.dumps(data))
    assert_refused(run_expertd("--pack", str(pack), "--endpoint", f"ipc://{tmp_path}/s.sock"), "modified")


@pytest.mark.parametrize("args,needles", [
    ((), ("no pack directory",)),
    (("--stage-slots", "0"), ("stage_slots: must be at least 1",)),
    (("--client-slots", "100", "--stage-slots", "10"), ("cannot exceed stage_slots",)),
    (("--endpoint", "tcp://127.0.0.1:5555"), ("needs curve_secret_key_file", "refused")),
    (("--endpoint", "inproc://x"), ("ipc:// or tcp://",)),
    (("--log-level", "loud"), ("log_level",)),
    (("--heartbeat-timeout-s", "inf"), ("heartbeat_timeout_s: must lie in",)),
    (("--heartbeat-timeout-s", "nan"), ("heartbeat_timeout_s: must lie in",)),
    (("--heartbeat-interval-s", "-1"), ("heartbeat_interval_s: must lie in",)),
    (("--heartbeat-interval-s", "2", "--heartbeat-timeout-s", "3"), ("must be at least twice heartbeat_interval_s",)),
    (("--read-threads", "100000"), ("read_threads: must lie in 1..256",)),
    (("--read-splits", "1000"), ("read_splits: must lie in",)),
    (("--stage-slots", "1000000000"), ("stage_slots: must lie in",)),
])
def test_bad_configuration(tiny_pack: Path, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    pack = ("--pack", str(tiny_pack)) if args else ()
    assert_refused(run_expertd(*pack, *args), *needles)


def test_config_file_with_every_problem_listed(tmp_path: Path) -> None:
    cfg = tmp_path / "expertd.toml"
    cfg.write_text('pack = "/nowhere"\nstage_slots = "many"\nspeed = 11\n')
    assert_refused(run_expertd("--config", str(cfg)), "unknown key 'speed'", "stage_slots: expected int")


def test_config_file_and_flags(tiny_pack: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "expertd.toml"
    cfg.write_text(f'pack = "{tiny_pack}"\nendpoint = "ipc://{tmp_path}/from-file.sock"\n'
                   'stage_slots = 20\nclient_slots = 4\nread_splits = 2\n')
    d = start_daemon(tiny_pack, tmp_path, "--config", str(cfg), "--client-slots", "5")
    d.wait_for("READY=1")  # the flag's endpoint wins over the file's; the file's slots count
    try:
        with ExpertClient(d.endpoint) as client:
            stats = client.stats()
        assert stats["config"]["stage_slots"] == 20 and stats["config"]["client_slots"] == 5
        assert stats["config"]["read_splits"] == 2
        assert not (tmp_path / "from-file.sock").exists()
    finally:
        assert d.stop()[0] == 0


def test_help_documents_every_key() -> None:
    proc = run_expertd("--help")
    assert proc.returncode == 0
    for flag in ("--pack", "--endpoint", "--stage-slots", "--client-slots", "--read-threads", "--read-splits",
                 "--direct-io", "--heartbeat-interval-s", "--heartbeat-timeout-s", "--curve-secret-key-file",
                 "--log-level", "--config"):
        assert flag in proc.stdout


@pytest.mark.parametrize("victim", ["experts.pack", "manifest.json", "a-directory"])
def test_endpoint_on_a_file_that_is_not_a_socket_touches_nothing(tiny_pack: Path, tmp_path: Path, victim: str) -> None:
    """An endpoint naming the pack itself (or any file or folder that is not a socket) is refused
    with the path named; nothing is removed, the pack still verifies byte for byte."""
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    target = pack / victim
    if victim == "a-directory":
        target.mkdir()
    before = None if target.is_dir() else target.read_bytes()
    proc = run_expertd("--pack", str(pack), "--endpoint", f"ipc://{target}")
    assert_refused(proc, str(target), "is not a socket")
    assert target.exists() and (target.is_dir() or target.read_bytes() == before)
    assert subprocess.run([str(BIN / "expertpack"), "verify", str(pack)], capture_output=True).returncode == 0


def test_staging_beyond_the_host_memory_is_refused_before_anything_is_made(tiny_pack: Path, tmp_path: Path) -> None:
    import os

    import psutil

    slots = 1 << 20  # the most the configuration takes
    need = slots * Manifest.load(tiny_pack).max_stride
    assert need > psutil.virtual_memory().available, "this host could lock the staging: the test needs a bigger pack"
    argv = [str(BIN / "expertd"), "--pack", str(tiny_pack), "--endpoint", f"ipc://{tmp_path}/s.sock",
            "--stage-slots", str(slots), "--client-slots", "1"]
    daemon = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = daemon.communicate(timeout=30)
    assert_refused(subprocess.CompletedProcess(argv, daemon.returncode, out, err),
                   "bytes of locked memory", "lower stage_slots", "fit now")
    # its own segments only (expertpack-PID-...): other tests' daemons may run beside it (make test's workers)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"expertpack-{daemon.pid}-")]
    assert not (tmp_path / "s.sock").exists()


# expertd with an audit hook that says on stderr when it creates its staging segment: the proof
# that a start failing after that point had one to remove.
EXPERTD_SAYING_CREATED = """
import os, sys
def seen(event, args):
    if event == "open" and str(args[0]).startswith("/dev/shm/expertpack-") and args[2] & os.O_CREAT:
        print(f"created {args[0]}", file=sys.stderr, flush=True)
sys.addaudithook(seen)
from expertpack.daemon.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["a taken TCP port", "an ipc path too long for a socket"])
def test_a_socket_that_cannot_be_bound_leaves_no_staging(tiny_pack: Path, tmp_path: Path, where: str) -> None:
    """The socket is bound after the staging is created and locked: a bind that fails must take the
    segment (and the endpoint's lock file) with it."""
    import socket
    import sys

    import zmq.auth

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if where == "a taken TCP port":
            _, secret = zmq.auth.create_certificates(str(tmp_path), "expertd")
            endpoint, needle = f"tcp://127.0.0.1:{taken.getsockname()[1]}", "Address already in use"
            extra: tuple[str, ...] = ("--curve-secret-key-file", secret)
        else:
            deep = tmp_path / ("d" * 120)
            deep.mkdir()
            endpoint, needle, extra = f"ipc://{deep}/expertd.sock", "is longer than 107 characters", ()
        before = set(tmp_path.rglob("*"))
        proc = subprocess.run([sys.executable, "-c", EXPERTD_SAYING_CREATED, "--pack", str(tiny_pack), "--endpoint",
                               endpoint, "--ram-cache-gib", "0", *extra], capture_output=True, text=True, timeout=30)
    assert_refused(proc, "cannot start", needle)
    created = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("created /dev/shm/")]
    assert created, f"the start failed before the staging was made: {proc.stderr}"
    assert not [path for path in created if Path(path).exists()], "the staging segment outlived the failed start"
    assert set(tmp_path.rglob("*")) == before, "a socket or lock file was left behind"


def test_the_endpoint_directory_is_made_when_missing(tiny_pack: Path, tmp_path: Path) -> None:
    """A user's $XDG_RUNTIME_DIR/expertpack, which no systemd unit made: expertd makes it (0750,
    like `mkdir -p` with its parents) and serves there."""
    run = tmp_path / "run" / "expertpack"
    d = start_daemon(tiny_pack, tmp_path, "--endpoint", f"ipc://{run}/expertd.sock")
    try:
        d.wait_for("READY=1")
        assert (run / "expertd.sock").is_socket() and (run.stat().st_mode & 0o777) == 0o750
        with ExpertClient(f"ipc://{run}/expertd.sock") as client:
            assert client.ping() > 0
    finally:
        assert d.stop()[0] == 0
    assert not (run / "expertd.sock").exists()


def test_an_endpoint_directory_that_cannot_be_made_is_named(tiny_pack: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = run_expertd("--pack", str(tiny_pack), "--endpoint", f"ipc://{tmp_path}/file/run/expertd.sock")
    assert_refused(proc, f"cannot create {tmp_path}/file/run, the directory of the endpoint's socket")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
