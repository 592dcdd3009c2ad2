"""Two expert-worker processes (one per GPU on a real host; both on the CPU here) against one real
expertd, as `expert-worker --device cuda:0` and `--device cuda:1` run side by side:

- generating at the same time, each gives token for token, and logprob for logprob, what a worker
  alone gave for the same request;
- `expertctl stats` lists both, told apart by name and pid, with their own counters;
- the daemon's RAM tier is shared: every expert the second worker asks for was read once, for the
  first, and is a RAM hit for it (no pack byte is read for the second worker at all);
- with a small staging (two slots a client) neither starves: both generate concurrently to the end;
- each worker's /metrics has expertd's counters for its own session beside the daemon-wide ones.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from expertpack.worker.serve.main import client_name

from ..conftest import BIN, start_daemon
from ..helpers.worker import Worker, metric_values, start_worker

PROMPTS = ("The quick brown fox", "Once upon a time in a land far away")
N_TOKENS = 12


def complete(worker: Worker, prompt: str) -> tuple[dict, float, float]:
    """(the greedy choice with its top-5 logprobs, start, end): what the runs compare."""
    start = time.monotonic()
    got = worker.client().completions.create(model="fixture", prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                             logprobs=5, extra_body={"ignore_eos": True})
    choice = got.choices[0]
    return {"text": choice.text, "logprobs": choice.logprobs.model_dump()}, start, time.monotonic()


def expertctl_stats(endpoint: str, *flags: str) -> str:
    proc = subprocess.run([str(BIN / "expertctl"), "stats", "--endpoint", endpoint, *flags], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_two_workers_share_one_expertd(tiny_pack: Path, tmp_path: Path) -> None:
    daemon = start_daemon(tiny_pack, tmp_path, "--stage-slots", "8", "--client-slots", "2", "--ram-cache-gib", "1")
    daemon.wait_for("READY=1")
    workers: list[Worker] = []
    try:
        for sub in ("a", "b"):
            (tmp_path / sub).mkdir()
        workers.append(start_worker(tiny_pack, daemon.endpoint, tmp_path / "a"))
        alone = {prompt: complete(workers[0], prompt)[0] for prompt in PROMPTS}
        assert all(len(r["logprobs"]["tokens"]) == N_TOKENS for r in alone.values())
        first = json.loads(expertctl_stats(daemon.endpoint, "--json"))
        workers.append(start_worker(tiny_pack, daemon.endpoint, tmp_path / "b"))

        results: dict[int, list[tuple[str, dict, float, float]]] = {0: [], 1: []}
        errors: list[BaseException] = []

        def generate(i: int) -> None:
            try:  # the two in opposite order: at any moment they want other experts
                for prompt in (PROMPTS if i == 0 else PROMPTS[::-1]) * 2:
                    results[i].append((prompt, *complete(workers[i], prompt)))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=generate, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors and not any(t.is_alive() for t in threads), errors
        stats = json.loads(expertctl_stats(daemon.endpoint, "--json"))
        table = expertctl_stats(daemon.endpoint)
        metrics = [metric_values(w) for w in workers]
    finally:
        codes = [w.stop() for w in workers]
        code, log = daemon.stop()
    assert codes == [0] * len(workers) and all("Traceback" not in w.log for w in workers), [w.log for w in workers]
    assert code == 0 and "Traceback" not in log, log

    for i in (0, 1):
        for prompt, got, _, _ in results[i]:
            assert got == alone[prompt], (i, prompt)
    # Both generated at once: each one's requests overlap the other's.
    spans = [(min(r[2] for r in results[i]), max(r[3] for r in results[i])) for i in (0, 1)]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans

    names = [client_name("fixture", "cpu", w.proc.pid) for w in workers]
    by = {c["name"]: c for c in stats["clients"]}
    assert set(by) == set(names), stats["clients"]
    a, b = by[names[0]], by[names[1]]
    assert (a["pid"], b["pid"]) == (workers[0].proc.pid, workers[1].proc.pid)
    assert a["slots"] == b["slots"] == 2
    for w, name in zip(workers, names):  # what an operator matches `expertctl stats` against
        assert f"2 staging slots of expertd as client '{name}'" in w.log, w.log
    # Every read happened while worker A was alone: B's experts, and A's since, were all RAM hits.
    a_alone = next(c for c in first["clients"] if c["name"] == names[0])
    assert a_alone["ram_misses"] > 0 and a_alone["read_bytes"] > 0
    assert (a["ram_misses"], a["read_bytes"]) == (a_alone["ram_misses"], a_alone["read_bytes"])
    assert stats["counters"]["pack_read_bytes"] == first["counters"]["pack_read_bytes"] == a["read_bytes"]
    assert b["keys"] > 0 and b["ram_hits"] == b["keys"] == b["ready"] and b["ram_misses"] == 0 and b["read_bytes"] == 0
    assert a["ram_hits"] > a_alone["ram_hits"]
    # No key failed but the lookahead's cancels of stale prefetches, which timing decides (a loaded
    # 2-core host once cancelled one). They count among FAILs; the daemon-wide counters also count them alone.
    assert stats["counters"]["failed"] == stats["counters"]["cancelled"] and stats["counters"]["io_errors"] == 0
    for name, c in ((names[0], a), (names[1], b)):
        assert c["served_bytes"] > 0 and c["demand_latency_us"]["count"] > 0, (name, c)
        assert name in table
    assert "ram hits" in table and f"pid {workers[1].proc.pid}" in table
    # Each worker's /metrics: its own session's counters, not the daemon's sum over both.
    for c, values in ((a, metrics[0]), (b, metrics[1])):
        for key in ("keys", "ram_hits", "ram_misses", "read_bytes", "served_bytes"):
            assert values[f"expertpack_daemon_client_{key}_total"] == c[key], (key, c, values)
    assert metrics[1]["expertpack_daemon_client_read_bytes_total"] == 0
    assert metrics[1]["expertpack_daemon_read_bytes_total"] > 0  # the daemon's, read for worker A
