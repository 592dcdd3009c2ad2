"""The bad-input table of issue 15 (defects 6, 7 and 10), one row per input, every program held to
the same three rules: exit status 2, exactly one line on stderr (no traceback), and nothing
touched: the pack's files keep their bytes and times, no staging segment appears in /dev/shm, no
socket or lock file is left. Rows whose one-line refusal is already checked elsewhere with nothing
created are not repeated here (build --safety-margin-gib nan|inf|-1, expert-worker --device bogus,
a chat "seed": 2**64, verify on n_expert = 10**12, the endpoint naming the pack, a permission-denied
socket, a losing concurrent expertd, truncated GGUFs, a taken port); this table adds the rows that
were checked for their exit status only, or not at all (a truncated pack at start, --device cuda
on a host without CUDA, the numbers of `expertpack bench io` and `expertpack plan`). The
expert-worker rows listen on a free port: the worker binds it before it checks the device, and a
taken default port would answer "cannot listen" instead."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from expertpack.packtools.layout import PACK_FILE, Manifest

from ..conftest import BIN, free_port

# (program, its arguments after the pack, which pack, the words the one line must hold). expertd
# and expert-worker take the pack as --pack PACK; `expertpack VERB` as its first argument.
ROWS = [
    ("expertd", ("--heartbeat-timeout-s", "inf"), "good", "heartbeat_timeout_s: must lie in"),
    ("expertd", ("--heartbeat-timeout-s", "nan"), "good", "heartbeat_timeout_s: must lie in"),
    ("expertd", ("--read-threads", "100000"), "good", "read_threads: must lie in 1..256"),
    ("expertd", ("--stage-slots", "-3"), "good", "stage_slots: must be at least 1"),
    ("expertd", ("--stage-slots", "1048576", "--client-slots", "1"), "good", "bytes of locked memory"),
    ("expertd", ("--client-slots", "9", "--stage-slots", "8"), "good", "cannot exceed stage_slots"),
    ("expertd", ("--ram-cache-gib", "-1"), "good", "ram_cache_gib: must lie in 0..65,536, got -1.0"),
    ("expertd", ("--ram-cache-gib", "nan"), "good", "ram_cache_gib: must lie in 0..65,536, got nan"),
    ("expertd", ("--ram-cache-gib", "65536"), "good", "lower ram_cache_gib (at most"),  # beyond the host, not the pack
    ("expertd", ("--endpoint", "inproc://x"), "good", "ipc:// or tcp://"),
    ("expertd", (), "truncated", "bytes but the manifest says"),
    ("expertd", (), "manifest-only", "missing"),
    ("expert-worker", ("--device", "cuda"), "good", "--device cuda"),
    ("expert-worker", ("--device", "cuda:0"), "good", "--device cuda:0"),
    ("expert-worker", ("--daemon-timeout-s", "inf"), "good", "daemon_timeout_s: must lie in"),
    ("expertpack bench io", ("--gb", "nan"), "good", "--gb must lie in 0.001..1,000, got nan"),
    ("expertpack bench io", ("--gb", "-1"), "good", "--gb must lie in 0.001..1,000, got -1.0"),
    ("expertpack bench io", ("--read-splits", "0"), "good", "--read-splits must lie in 1..64, got 0"),
    ("expertpack bench io", ("--latency-requests", "-5"), "good", "--latency-requests must lie in 1..100,000"),
    ("expertpack bench io", ("--read-threads", "100000"), "good", "--read-threads must lie in 1..256"),
    ("expertpack bench io", ("--seed", "-1"), "good", "--seed must lie in 0.."),
    ("expertpack bench io", (), "truncated", "bytes but the manifest says"),
    ("expertpack bench io", (), "manifest-only", "missing"),
    ("expertpack plan", ("--vram-gib", "-1"), "good", "--vram-gib must lie in 0.001..1,000,000, got -1.0"),
    ("expertpack plan", ("--disk-gbps", "nan"), "good", "--disk-gbps must lie in"),
    ("expertpack plan", ("--ram-gib", "inf"), "good", "--ram-gib must lie in 0..1,000,000, got inf"),
    ("expertpack plan", ("--prompt-tokens", "0"), "good", "--prompt-tokens must lie in 1..1,048,576, got 0"),
    ("expertpack plan", ("--layers", "4", "--write", "x"), "good", "--write writes the settings of the pack given"),
]


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under root: (size, mtime_ns, inode), so a rewrite or a replacement shows."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def packs(tiny_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    out = {name: root / name for name in ("good", "truncated", "manifest-only")}
    for path in out.values():
        shutil.copytree(tiny_pack, path)
    m = Manifest.load(out["truncated"])
    with open(out["truncated"] / PACK_FILE, "r+b") as f:
        f.truncate(m.layers[-1].block_offset(3))  # cut inside the last layer, at a block boundary
    (out["manifest-only"] / PACK_FILE).unlink()
    return out


@pytest.mark.parametrize("program,args,which,needle", ROWS, ids=[f"{r[0]} {' '.join(r[1]) or r[2]}" for r in ROWS])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(packs: dict[str, Path], tmp_path: Path, program: str,
                                                          args: tuple[str, ...], which: str, needle: str) -> None:
    pack = packs[which]
    before = snapshot(pack)
    endpoint = f"ipc://{tmp_path}/expertd.sock"
    if program.startswith("expertpack "):
        argv = [str(BIN / "expertpack"), *program.split()[1:], str(pack)]
    elif program == "expertd":
        argv = [str(BIN / program), "--pack", str(pack), "--endpoint", endpoint]
    else:
        argv = [str(BIN / program), "--pack", str(pack), "--daemon", endpoint, "--port", str(free_port())]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, also on a machine that has one
    proc = subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, stderr = proc.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert needle in lines[0], lines[0]
    assert snapshot(pack) == before, "the pack was touched"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"expertpack-{proc.pid}-")], "staging left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a socket or lock file was left behind"
