"""Shared test fixtures: the real llama.cpp GGUFs in tests/fixtures (made by others, the outside world:
tests/fixtures/README.md says how), packs built from them once per session, a helper to run the installed CLI, and a real
expertd process on a real pack on the ext4 disk, its readiness learned the way systemd learns it (a
NOTIFY_SOCKET datagram), stopped with SIGTERM and checked for leftovers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be on before any kernel is
# defined (at import): here, so that every test folder run alone (tests/worker's kernel cases) gets it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from expertpack.packtools.build import BuildOptions, build_pack  # noqa: E402
from expertpack.packtools.synth.writer import SynthOptions, write_synth  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The files the tests read, carried in the repository; EXPERTPACK_FIXTURES points them at another
# copy of the same layout (the full set the carried files were cut from, say).
FIXTURES = Path(os.environ.get("EXPERTPACK_FIXTURES", REPO / "tests" / "fixtures"))
IQ_FIXTURES = REPO / "tests" / "fixtures" / "iq"  # made here with llama.cpp's tools (its README.md): always the repository's
BIN = Path(sys.executable).parent  # the venv's console scripts; else they are found on PATH
if not (BIN / "expertd").exists() and shutil.which("expertd"):
    BIN = Path(shutil.which("expertd")).parent


def fixture_ggufs() -> list[Path]:
    """Every fixture model: single files and the first shard of each split set."""
    if not FIXTURES.is_dir():
        raise RuntimeError(f"fixtures not found at {FIXTURES} (EXPERTPACK_FIXTURES, or tests/fixtures)")
    paths = sorted(p for p in FIXTURES.rglob("*.gguf") if "-of-" not in p.name or "-00001-of-" in p.name)
    assert len(paths) >= 10, f"expected the shared fixture GGUFs under {FIXTURES}, found {paths}"
    return paths


def fixture_id(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str | Path, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the installed `expertpack` console script."""
    proc = subprocess.run([str(BIN / "expertpack"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"expertpack {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# Triton's interpreter runs a launch's programs one after another in Python, each operation over a
# whole tile, so its time goes with the program count: whole-model tests on the CPU give the
# row-tiled kernels 64 rows a program (the GPU's 16 or 32), about a third of the time (DeepSeek-V4's
# tiny model, a prompt and three steps: 107 -> 35 s in the kernels). What they check (the torch
# path's logits within float32 rounding, an expert cache against every expert resident bit for bit)
# holds in any tiling; tests/kernels tests each kernel at the GPU's tiles.
INTERPRETER_ROWS = 64


@pytest.fixture
def interpreter_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    from expertpack.worker.nn.backend import kernels_on_cpu

    with kernels_on_cpu():  # defined for the interpreter, as the tests' first kernel call would
        from expertpack.worker.kernels import linear_tl, moe_dense, moe_tiles, moe_tl
    for module, name in ((linear_tl, "BN_MATVEC"), (linear_tl, "BN_REGROUPED"), (linear_tl, "BN_DEQUANT"),
                         (moe_tl, "BN"), (moe_tiles, "BN"), (moe_dense, "BN_DEQUANT")):
        monkeypatch.setattr(module, name, max(getattr(module, name), INTERPRETER_ROWS))


@pytest.fixture
def short_reservations(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV buffers of a few positions, for the engine's static steps under Triton's interpreter, which
    attends over every reserved position."""
    from expertpack.worker.engine import engine as engine_module
    from expertpack.worker.nn import layers

    monkeypatch.setattr(engine_module, "MIN_STATIC_CAPACITY", 8)
    monkeypatch.setattr(layers, "INITIAL_CAPACITY", 3)


@pytest.fixture(scope="session")
def fixture_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """fixture id -> (source GGUF, built pack directory), built once per session."""
    root = tmp_path_factory.mktemp("fixture-packs")
    packs = {}
    for src in fixture_ggufs():
        out = root / fixture_id(src)
        build_pack(src, out, BuildOptions(progress=False, safety_margin_bytes=0))
        packs[fixture_id(src)] = (src, out)
    return packs


# The models whose packs a worker split over devices streams through expertd
CACHED = {"qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf", "deepseek2": "gguf/deepseek3-a/deepseek3-a.Q4_K_M.gguf"}


@pytest.fixture(scope="module")
def split_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The CACHED models' packs, for tests/worker/test_multi_device.py and, through the kernels,
    tests/kernels/test_split_kernels.py: built once in each module that takes them (module scope, as
    when each module had them as its own fixture)."""
    root = tmp_path_factory.mktemp("multi-device-packs")
    out = {}
    for arch, path in CACHED.items():
        out[arch] = root / arch
        build_pack(FIXTURES / path, out[arch], BuildOptions(progress=False, safety_margin_bytes=0))
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_synth(path, SynthOptions(preset="tiny", progress=False))
    return path


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    endpoint: str
    socket_path: Path
    notify: socket.socket
    log_path: Path
    notes: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, state: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(state in n for n in self.notes):
            if self.proc.poll() is not None:
                raise AssertionError(f"expertd exited {self.proc.returncode}: {self.log}")
            self.notify.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
            try:
                self.notes.append(self.notify.recv(4096).decode())
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"expertd never said {state}")

    def stop(self) -> tuple[int, str]:
        """SIGTERM; returns (exit status, stderr). Notifications sent meanwhile land in `notes`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
            self.notify.setblocking(False)
            while True:
                try:
                    self.notes.append(self.notify.recv(4096).decode())
                except BlockingIOError:
                    break
        finally:
            self.notify.close()
        return self.proc.returncode, self.log


def start_daemon(pack: Path, tmp: Path, *extra: str, on_ramfs: bool = False) -> Daemon:
    """expertd on `pack`, its log in tmp/expertd.log. on_ramfs: the pack is first copied onto a ramfs
    (which refuses O_DIRECT) mounted in a private mount namespace that dies with the daemon. Without
    a RAM tier unless `extra` gives --ram-cache-gib: most tests are about reads (counted bytes, a
    pack damaged between two fetches), which a RAM tier holding a whole tiny pack would answer
    from memory; tests/daemon/test_ram_tier.py tests the tier."""
    sock_path = tmp / "expertd.sock"
    notify_path = tmp / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    ram = () if any(a.startswith("--ram-cache-gib") for a in extra) else ("--ram-cache-gib", "0")
    argv = [str(BIN / "expertd"), "--pack", str(pack), "--endpoint", f"ipc://{sock_path}", "--log-level", "debug",
            *ram, *extra]
    if on_ramfs:
        mnt = tmp / "ramfs"
        mnt.mkdir()
        argv[2] = str(mnt / "pack")
        argv = ["unshare", "-rm", "sh", "-c", f'mount -t ramfs ramfs "{mnt}" && cp -a "{pack}" "{mnt}/pack" && exec "$@"',
                "sh", *argv]
    log_path = tmp / "expertd.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, text=True,
                                env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
    return Daemon(proc, f"ipc://{sock_path}", sock_path, notify, log_path)


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pack on the ext4 disk (pytest's tmp lives there here and in CI), 4 layers x 16 experts."""
    root = tmp_path_factory.mktemp("daemon-pack")
    src = root / "tiny.gguf"
    write_synth(src, SynthOptions(preset="tiny", progress=False, seed=11))
    out = root / "pack"
    build_pack(src, out, BuildOptions(progress=False, safety_margin_bytes=0))
    return out


@pytest.fixture
def daemon(tiny_pack: Path, tmp_path: Path):
    # The test process plays several clients at once: no per-process cap below the whole staging
    # (tests/daemon/test_fairness.py tests the cap).
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "48", "--client-slots", "8", "--max-client-slots", "48")
    d.wait_for("READY=1")
    yield d
    code, err = d.stop()
    assert code == 0, err
    assert not d.socket_path.exists(), "the ipc socket file is left behind"
    assert not any(p.name.startswith(f"expertpack-{d.proc.pid}-") for p in Path("/dev/shm").iterdir()), \
        "the staging segment is left behind"
