"""Several clients on one real expertd, as several workers (one per GPU) use it: STATS and
`expertctl stats` say per client who it is (name, pid), what it asked, what it was served, what was
read for it and what the RAM tier answered; a block one client had read is a RAM hit for the next
(no read of its own); and a client flooding the daemon with keys does not starve another one's
demand fetch (each is served from its own leased slots, so the reader queue never holds more of
one client's reads than its share), and two equally busy clients get the reads in turn."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from expertpack.client import ExpertClient
from expertpack.client.expertctl import main as expertctl_main
from expertpack.packtools.layout import ExpertKey, Manifest

from ..conftest import start_daemon
from ..helpers.expertd import all_keys, ram_daemon


def clients_by_name(stats: dict) -> dict[str, dict]:
    return {c["name"]: c for c in stats["clients"]}


def drain(client: ExpertClient, keys: list[ExpertKey]) -> None:
    for expert in client.fetch(keys, timeout_s=30):
        expert.release()


def test_a_second_client_reads_nothing_the_first_one_had_read(tiny_pack: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    m = Manifest.load(tiny_pack)
    keys = [k for k in all_keys(m) if k.layer == m.layers[0].layer]
    payload = m.layers[0].payload_bytes
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint, name="worker-a") as a, ExpertClient(d.endpoint, name="worker-b") as b:
            drain(a, keys)
            drain(b, keys)
            drain(b, keys[:3])
            a.stats(), b.stats()  # answered after each one's RELEASEs (one connection keeps its order)
            assert expertctl_main(["stats", "--endpoint", d.endpoint, "--json"]) == 0
            stats = json.loads(capsys.readouterr().out)
            assert expertctl_main(["stats", "--endpoint", d.endpoint]) == 0
            table = capsys.readouterr().out
    by = clients_by_name(stats)
    assert set(by) == {"worker-a", "worker-b"}, stats["clients"]
    ca, cb = by["worker-a"], by["worker-b"]
    assert ca["pid"] == cb["pid"] == os.getpid()  # SO_PEERCRED of each connection
    assert (ca["fetches"], ca["keys"], ca["ready"], ca["failed"]) == (1, 16, 16, 0)
    assert (cb["fetches"], cb["keys"], cb["ready"], cb["failed"]) == (2, 19, 19, 0)
    assert (ca["ram_hits"], ca["ram_misses"]) == (0, 16)
    assert (cb["ram_hits"], cb["ram_misses"]) == (19, 0)  # every key of b was resident: a's reads
    assert cb["read_bytes"] == 0 and ca["read_bytes"] == stats["counters"]["pack_read_bytes"] >= 16 * payload
    assert (ca["served_bytes"], cb["served_bytes"]) == (16 * payload, 19 * payload)
    assert ca["demand_latency_us"]["count"] == 16 and cb["demand_latency_us"]["count"] == 19
    assert ca["ram_held"] == cb["ram_held"] == 0 and ca["queued"] == cb["queued"] == 0
    lines = table.splitlines()
    i = next(i for i, line in enumerate(lines) if "worker-b" in line)
    assert f"pid {os.getpid()}" in lines[i] and "ram held 0" in lines[i] and ", kept 0 of " in lines[i], lines[i]
    assert "keys 19" in lines[i + 1] and "read 0.0 MB" in lines[i + 1] and "ram hits 19 (100.0%)" in lines[i + 1], \
        lines[i + 1]


def test_a_flooding_client_does_not_starve_another(tiny_pack: Path, tmp_path: Path) -> None:
    """One reader thread and two slots a client, no RAM tier: every key is a read. The flooder asks
    for 1,024 keys at once and keeps consuming them; the other client's 8 demand keys must arrive
    long before the flood is through (a daemon that queued reads in arrival order would serve them
    after it)."""
    m = Manifest.load(tiny_pack)
    flood = (all_keys(m) * 16)[:1024]
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "4", "--client-slots", "2", "--read-threads", "1",
                     "--max-client-slots", "4")  # two clients of this one process
    d.wait_for("READY=1")
    try:
        with ExpertClient(d.endpoint, name="flooder") as flooder, ExpertClient(d.endpoint, name="modest") as modest:
            served = 0
            errors: list[BaseException] = []

            def consume() -> None:
                nonlocal served
                try:
                    for expert in flooder.fetch(flood, timeout_s=60):
                        expert.release()
                        served += 1
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            thread = threading.Thread(target=consume)
            thread.start()
            while served < 32:  # the flood is under way: its keys fill the daemon's queue
                time.sleep(0.001)
            t0 = time.perf_counter()
            drain(modest, all_keys(m)[:8])
            modest_s = time.perf_counter() - t0
            at_modest = served
            stats = modest.stats()
            thread.join(120)
            assert not thread.is_alive() and not errors, errors
    finally:
        code, log = d.stop()
        assert code == 0, log
    assert served == len(flood)
    assert at_modest < len(flood) // 2, (at_modest, modest_s)
    by = clients_by_name(stats)
    assert by["modest"]["ready"] == 8 and by["modest"]["ram_misses"] == 8
    assert by["flooder"]["keys"] == len(flood) and by["flooder"]["queued"] > 0


def test_two_busy_clients_share_the_reads(tiny_pack: Path, tmp_path: Path) -> None:
    """Two clients with two slots each, both asking for 512 keys at once, one reader thread, no RAM
    tier: when the first is through, the second has had a fair share of the reads too (each has at
    most its two slots' reads queued, so the reader alternates between them)."""
    m = Manifest.load(tiny_pack)
    keys = (all_keys(m) * 8)[:512]
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "4", "--client-slots", "2", "--read-threads", "1",
                     "--max-client-slots", "4")  # two clients of this one process
    d.wait_for("READY=1")
    try:
        with ExpertClient(d.endpoint, name="one") as one, ExpertClient(d.endpoint, name="two") as two:
            served = {"one": 0, "two": 0}
            at_first_done: list[dict[str, int]] = []
            errors: list[BaseException] = []
            start = threading.Barrier(2)

            def consume(name: str, client: ExpertClient) -> None:
                try:
                    start.wait()
                    for expert in client.fetch(keys, timeout_s=60):
                        expert.release()
                        served[name] += 1
                    if not at_first_done:
                        at_first_done.append(dict(served))
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            threads = [threading.Thread(target=consume, args=(n, c)) for n, c in (("one", one), ("two", two))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors and not any(t.is_alive() for t in threads), errors
    finally:
        code, log = d.stop()
        assert code == 0, log
    assert served == {"one": 512, "two": 512}
    assert min(at_first_done[0].values()) >= 512 // 2, at_first_done  # seen here: 508..511 of 512
