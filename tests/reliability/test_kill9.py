"""kill -9 of the expert-worker in the middle of a streamed generation: expertd gives its leases
back within seconds (nothing leased, nothing being read, no client left), keeps serving, and a new
worker on the same daemon streams the text of a clean run byte for byte. (kill -9 of expertd during
a generation, and the restarted daemon's identical text, are in tests/worker/test_daemon_recovery.py
and test_expert_worker.py; a plain client SIGKILLed while holding slots in tests/daemon/test_faults.py.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from expertpack.worker.serve.main import client_name

from ..conftest import start_daemon
from ..helpers.expertd import wait_stats
from ..helpers.worker import PACK, start_worker

PROMPT = "A long story begins"
N_TOKENS = 24


def stream_text(worker, max_tokens: int) -> str:
    chunks = worker.client().completions.create(model="fixture", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks)


@pytest.mark.slow
def test_a_worker_killed_mid_generation_gives_its_leases_back(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[PACK][1]
    for sub in ("first", "second"):
        (tmp_path / sub).mkdir()
    daemon = start_daemon(pack, tmp_path, "--stage-slots", "24", "--client-slots", "4")
    daemon.wait_for("READY=1")
    workers = [start_worker(pack, daemon.endpoint, tmp_path / "first")]
    name = client_name("fixture", "cpu", workers[0].proc.pid)  # what its HELLO says: program, pid, model, device
    try:
        clean = stream_text(workers[0], N_TOKENS)
        assert clean
        stream = workers[0].client().completions.create(model="fixture", prompt=PROMPT, max_tokens=2000,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        held = wait_stats(daemon.endpoint, lambda s: any(c["name"] == name for c in s["clients"]))
        assert any(c["name"] == name for c in held["clients"]), held["clients"]  # its lease, mid-generation
        workers[0].proc.send_signal(signal.SIGKILL)  # mid-generation: fetches in flight, slots leased
        workers[0].proc.wait()
        start = time.monotonic()
        stats = wait_stats(daemon.endpoint, lambda s: [c["name"] for c in s["clients"]] == ["observer"]
                           and not s["slots"]["reading"] and not s["slots"]["leased"])
        back_s = time.monotonic() - start
        assert [c["name"] for c in stats["clients"]] == ["observer"], stats["clients"]
        assert stats["slots"]["leased"] == 0 and stats["slots"]["reading"] == 0
        assert stats["slots"]["unleased"] == stats["slots"]["total"] - 4  # the observer's 4 only
        assert back_s < 5, f"leases came back after {back_s:.1f} s"
        print(f"leases back {back_s:.2f} s after kill -9")
        assert daemon.proc.poll() is None

        workers.append(start_worker(pack, daemon.endpoint, tmp_path / "second"))
        assert stream_text(workers[1], N_TOKENS) == clean
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                assert worker.stop() == 0, worker.log
        code, log = daemon.stop()
    assert code == 0 and "Traceback" not in log, log
    assert f"client '{name}' (pid {workers[0].proc.pid}) disconnected" in log
