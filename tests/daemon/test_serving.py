"""The real daemon serves the real client: every byte delivered equals the pack's bytes and the
manifest's sha256, in any key order, to several clients at once; demand overtakes prefetch; CANCEL
answers every key exactly once; one greedy client cannot starve another; clients map the staging
read-only."""

from __future__ import annotations

import hashlib
import random
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from expertpack.client import ExpertClient, Priority
from expertpack.client import protocol as p
from expertpack.packtools.layout import PACK_FILE, ExpertKey, Manifest

from ..conftest import Daemon, start_daemon
from ..helpers.expertd import all_keys, raw_session, recv, wait_stats


def check(expert, m: Manifest, packed: np.ndarray) -> None:
    layer = m.layer(expert.key.layer)
    assert expert.nbytes == layer.payload_bytes
    start = layer.block_offset(expert.key.expert)
    assert bytes(expert.data) == packed[start:start + layer.payload_bytes].tobytes()
    assert hashlib.sha256(expert.data).hexdigest() == layer.sha256[expert.key.expert]


def test_every_expert_arrives_byte_exact_in_random_orders(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    rng = random.Random(5)
    with ExpertClient(daemon.endpoint, name="exact", expect_fingerprint=m.fingerprint) as client:
        assert client.model["n_expert"] == m.model.n_expert and len(client.slots) == 8
        for round_ in range(3):
            keys = all_keys(m)
            rng.shuffle(keys)
            seen = []
            for expert in client.fetch(keys):
                check(expert, m, packed)
                seen.append(expert.key)
                expert.release()
            assert sorted(seen) == sorted(keys)
        stats = client.stats()
    c = stats["counters"]
    assert c["ready"] == 3 * len(keys) and c["io_errors"] == 0 and c["fallback_count"] == 0
    assert c["pack_read_bytes"] == 3 * sum(l.stride * m.model.n_expert for l in m.layers)
    assert stats["direct_io"] is True and stats["read_latency_us"]["count"] == c["read_ops"]


def test_several_clients_at_once(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = random.Random(seed)
            with ExpertClient(daemon.endpoint, name=f"w{seed}") as client:
                for _ in range(4):
                    keys = rng.sample(all_keys(m), 40)
                    got = 0
                    for expert in client.fetch(keys):
                        check(expert, m, packed)
                        expert.release()
                        got += 1
                    assert got == 40
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # The workers' leases come back once expertd sees their connections close: its socket monitor
    # tells it asynchronously, and a new connection's STATS may be read first.
    stats = wait_stats(daemon.endpoint, lambda s: s["slots"]["unleased"] == 48 - 8)
    assert stats["counters"]["ready"] == 5 * 4 * 40
    assert stats["slots"]["unleased"] == 48 - 8  # only the asking client's lease is out


def test_staging_and_socket_are_group_shared(daemon: Daemon) -> None:
    """The group may use the socket, and read the staging but not write it (what expertd owns,
    only expertd writes: issue 37)."""
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o660
    with ExpertClient(daemon.endpoint) as client:
        shm = Path("/dev/shm") / client.welcome.shm
        assert stat.S_IMODE(shm.stat().st_mode) == 0o640


def test_a_client_maps_the_staging_read_only(daemon: Daemon) -> None:
    """Issue 37: a client that wrote into a RAM tier block handed its bytes to every other client.
    The client library maps the segment read-only: an expert's bytes and the segment refuse writes."""
    with ExpertClient(daemon.endpoint) as client:
        expert = next(client.fetch([(0, 1)]))
        assert expert.data.readonly
        with pytest.raises(TypeError):
            expert.data[0] = 0
        with pytest.raises(TypeError):
            client.staging[expert.slot * client.welcome.slot_bytes] = 0
        expert.release()


def test_demand_overtakes_prefetch(tiny_pack: Path, tmp_path: Path) -> None:
    d = start_daemon(tiny_pack, tmp_path, "--read-threads", "1", "--read-splits", "8", "--stage-slots", "32",
                     "--client-slots", "32")
    d.wait_for("READY=1")
    try:
        m = Manifest.load(tiny_pack)
        with raw_session(d.endpoint) as (sock, welcome):
            prefetch = all_keys(m)  # 64 keys, more than the 32 slots
            sock.send(p.encode(p.Fetch(1, tuple(prefetch), Priority.PREFETCH)))
            sock.send(p.encode(p.Fetch(2, (ExpertKey(m.layers[-1].layer, 15),), Priority.DEMAND)))
            order = []
            while len(order) < len(prefetch) + 1:
                msg = recv(sock)
                assert isinstance(msg, p.Ready), msg
                order.append(msg.id)
                sock.send(p.encode(p.Release((msg.slot,))))
        demand_at = order.index(2)
        # The demand read jumps the reader queue: it lands long before the 64 prefetches finish.
        assert demand_at < 16, f"demand key answered {demand_at + 1}th of {len(order)}"
    finally:
        assert d.stop()[0] == 0


def test_cancel_answers_every_key_once(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    keys = tuple(all_keys(m))
    with raw_session(daemon.endpoint) as (sock, welcome):
        sock.send(p.encode(p.Fetch(7, keys, Priority.PREFETCH)))
        first = recv(sock)
        assert isinstance(first, p.Ready)  # reads are under way; we hold every slot from here on
        sock.send(p.encode(p.Cancel(7)))
        answers = [first]
        while len(answers) < len(keys):
            answers.append(recv(sock))
        ready = [a for a in answers if isinstance(a, p.Ready)]
        failed = [a for a in answers if isinstance(a, p.Fail)]
        assert len(ready) <= len(welcome.slots) and len(failed) >= len(keys) - len(welcome.slots)
        assert all(f.code is p.FailCode.CANCELLED for f in failed)
        assert sorted(a.key for a in answers) == sorted(keys)
        sock.send(p.encode(p.Ping()))
        assert isinstance(recv(sock), p.Pong)  # nothing more was queued behind the pong
        sock.send(p.encode(p.Release(tuple(r.slot for r in ready))))
        sock.send(p.encode(p.Fetch(8, keys[:3])))
        assert {recv(sock).id for _ in range(3)} == {8}


def test_greedy_client_cannot_starve_another(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    with raw_session(daemon.endpoint) as (greedy, _), ExpertClient(daemon.endpoint, name="polite") as client:
        greedy.send(p.encode(p.Fetch(1, tuple(all_keys(m)) * 100)))  # 6,400 keys, never released
        got = []
        for expert in client.fetch(all_keys(m)[:20], timeout_s=10):
            got.append(expert.key)
            expert.release()
        assert len(got) == 20
        stats = client.stats()
    queued = {c["name"]: c["queued"] for c in stats["clients"]}
    assert queued["raw"] == 6400 - 8  # its 8 slots hold experts; the rest waits for its own releases


def test_unknown_key_is_refused_whole(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint) as client:
        with pytest.raises(Exception, match="not an expert of this pack"):
            list(client.fetch([(0, 0), (0, m.model.n_expert)]))
        assert client.stats()["counters"]["keys"] == 0
        assert len(list(e.key for e in client.fetch([(0, 1)]))) == 1


def test_leaving_a_fetch_early_gives_every_slot_back(daemon: Daemon, tiny_pack: Path) -> None:
    with ExpertClient(daemon.endpoint, name="quitter") as client:
        stream = client.fetch([(0, e) for e in range(8)])
        first = next(stream)
        client.ping()  # routes the other READYs into the fetch's inbox meanwhile
        first.release()
        stream.close()  # abandon the rest
        stats = client.stats()
        deadline = time.monotonic() + 10
        # cancelled reads already issued finish on their own (a read cannot be recalled from the disk)
        while (stats["slots"]["leased"] or stats["slots"]["reading"]) and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = client.stats()
        assert stats["slots"]["leased"] == 0 and stats["slots"]["reading"] == 0
        assert sum(1 for e in client.fetch([(1, e) for e in range(8)]) if e.release() is None) == 8


def test_a_trunk_of_another_pack_is_refused_at_hello(daemon: Daemon) -> None:
    from expertpack.client import FingerprintMismatch

    with pytest.raises(FingerprintMismatch, match="built with pack"):
        ExpertClient(daemon.endpoint, expect_fingerprint="0" * 64)
