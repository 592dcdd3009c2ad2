"""`make demo` (scripts/demo.sh) end to end, as a user on a fresh clone runs it: synth, build,
verify, expertd, expert-worker, one chat request and its stats, a clean stop. Run in a temporary
directory (its `.venv` a link to this interpreter's environment), so nothing lands in the tree."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (Path(sys.prefix) / "bin" / "expert-worker").exists(),
                    reason="needs the project's console scripts installed in this environment (make venv)")
def test_the_demo_runs_end_to_end(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(sys.prefix)
    done = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DEMO_PORT": str(free_port())})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "POST /v1/chat/completions" in done.stdout and "MB of experts fetched from expertd" in done.stdout
    assert "demo done: expertd and expert-worker stopped cleanly" in done.stdout + done.stderr
