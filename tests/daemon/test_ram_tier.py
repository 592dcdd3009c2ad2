"""The RAM tier in a real expertd, through real sockets, on a real pack: a second fetch of the same
keys is answered from RAM without a read and byte-exact, by slot references into the segment the
client maps; a small budget evicts (and keeps the hot block through a scan of cold ones); a block
a client holds is never overwritten until it is released; a corrupt block is never made resident;
a tier of 0 serves from staging as before; a block altered in memory is never served; clients that release and vanish leave no hold behind; a client's RAM hold share is apart from its staging
(v6), and its prefetches take half of it, kept holds (v8) apart from both, of its reads and of its staging, its demand the rest; a bad ram_cache_gib in the file is one line and exit 2
(bad flags: tests/reliability/test_bad_input_table.py); STATS,
`expertctl stats` and the mlock state say what the tier does."""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from expertpack.client import ExpertClient, FetchFailed
from expertpack.client import protocol as p
from expertpack.client.expertctl import main as expertctl_main
from expertpack.packtools.layout import PACK_FILE, ExpertKey, Manifest

from ..conftest import BIN, start_daemon
from ..helpers.expertd import all_keys, alter_in_memory, flip_byte, ram_daemon, raw_session, recv

GIB = 1 << 30


def gib_for(slots: int, pack: Path) -> str:
    """--ram-cache-gib for exactly `slots` RAM slots of this pack (half a slot over, against rounding)."""
    return repr((slots + 0.5) * Manifest.load(pack).max_stride / GIB)


def payload(packed: np.ndarray, m: Manifest, key: ExpertKey) -> bytes:
    layer = m.layer(key.layer)
    start = layer.block_offset(key.expert)
    return packed[start:start + layer.payload_bytes].tobytes()


def fetch_all(client: ExpertClient, keys: list[ExpertKey], m: Manifest, packed: np.ndarray) -> list[int]:
    """Fetches and releases `keys`, checking every payload against the pack and its sha256; the slots."""
    slots = []
    for expert in client.fetch(keys):
        assert bytes(expert.data) == payload(packed, m, expert.key), expert
        assert hashlib.sha256(expert.data).hexdigest() == m.layer(expert.key.layer).sha256[expert.key.expert]
        slots.append(expert.slot)
        expert.release()
    return slots


def test_a_second_fetch_is_answered_from_ram_byte_exact(tiny_pack: Path, tmp_path: Path) -> None:
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    keys = all_keys(m)
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint, name="first") as client:
            w = client.welcome
            assert (w.ram_first_slot, w.ram_slots) == (32, len(keys))  # 1 GiB, capped at the whole pack
            assert w.shm_bytes == (32 + len(keys)) * w.slot_bytes
            fetch_all(client, keys, m, packed)
            read = client.stats()["counters"]["pack_read_bytes"]
        assert read == len(keys) * m.max_stride
        with ExpertClient(d.endpoint, name="second") as client:  # another client hits what the first read
            for _ in range(2):
                slots = fetch_all(client, list(reversed(keys)), m, packed)
                assert all(w.ram_first_slot <= s < w.ram_first_slot + w.ram_slots for s in slots)
                assert len(set(slots)) == len(keys)
            stats = client.stats()
    c, ram = stats["counters"], stats["ram"]
    assert c["pack_read_bytes"] == read and c["read_ops"] == len(keys) * 4  # not one read more
    assert (c["ram_hits"], c["ram_misses"], c["ram_evictions"]) == (2 * len(keys), len(keys), 0)
    assert ram["resident"] == len(keys) and ram["resident_bytes"] == sum(
        m.layer(k.layer).payload_bytes for k in keys)
    assert ram["held"] == 0 and c["checked_blocks"] == len(keys) and c["ready"] == 3 * len(keys)


def test_a_small_budget_evicts_and_keeps_the_hot_block(tiny_pack: Path, tmp_path: Path) -> None:
    """Four blocks of tier, a hot key and a scan of 20 cold ones: the hot block stays and is never
    read again, the scan evicts all but the latest cold keys, and an evicted key is read again. The
    scrub may check a block mid-scan, and a block under its check is not the victim: then one of the
    latest cold keys went instead of an older one (CI under load met it), and is read again."""
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    hot, cold = ExpertKey(0, 0), [k for k in all_keys(m) if k != ExpertKey(0, 0)][:20]
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", gib_for(4, tiny_pack)) as d, \
            ExpertClient(d.endpoint) as client:
        assert client.welcome.ram_slots == 4
        for _ in range(10):
            fetch_all(client, [hot], m, packed)
        scan = client.stats()
        for key in cold:  # a scan: each cold key once, in its own request
            fetch_all(client, [key], m, packed)
        before = client.stats()
        fetch_all(client, [hot], m, packed)  # still resident: no read
        kept = client.stats()
        fetch_all(client, cold[-3:], m, packed)  # the latest cold keys displaced the older ones
        after = client.stats()
        fetch_all(client, cold[:1], m, packed)  # the first cold key was evicted: read again
        last = client.stats()
    assert before["ram"]["resident"] == 4 and before["counters"]["ram_evictions"] == len(cold) - 3
    assert kept["counters"]["pack_read_bytes"] == before["counters"]["pack_read_bytes"]
    assert kept["counters"]["ram_hits"] == before["counters"]["ram_hits"] + 1
    read_again = after["counters"]["ram_misses"] - kept["counters"]["ram_misses"]
    checked = after["counters"]["ram_checks"] - scan["counters"]["ram_checks"]
    assert read_again == 0 or (read_again == 1 and checked > 0), f"{read_again} re-read, {checked} scrub checks"
    assert after["counters"]["ram_hits"] == kept["counters"]["ram_hits"] + 3 - read_again
    assert last["counters"]["pack_read_bytes"] == after["counters"]["pack_read_bytes"] + m.max_stride


def test_a_held_block_is_not_overwritten_until_released(tiny_pack: Path, tmp_path: Path) -> None:
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    held, other = ExpertKey(1, 3), ExpertKey(2, 9)
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", gib_for(1, tiny_pack)) as d, \
            ExpertClient(d.endpoint, name="holder") as holder, ExpertClient(d.endpoint, name="busy") as busy:
        expert = next(holder.fetch([held]))
        assert expert.slot == holder.welcome.ram_first_slot
        for _ in range(6):  # `other` is asked for far more often than `held`: it would take its slot
            slots = fetch_all(busy, [other], m, packed)
            assert slots[0] != expert.slot  # served from busy's staging instead
            assert bytes(expert.data) == payload(packed, m, held)
        stats = busy.stats()
        assert stats["ram"]["held"] == 1 and stats["counters"]["ram_evictions"] == 0
        expert.release()
        holder.ping()  # the RELEASE is in before busy asks again
        checks = busy.stats()["counters"]["ram_checks"]
        slots = fetch_all(busy, [other], m, packed)
        if slots != [holder.welcome.ram_first_slot]:
            # The scrub was checking the released block, and a block under its check is not the victim
            # (ram_tier.RamSlot.checking): a slow run met it once. Once that check is done, it is.
            deadline = time.monotonic() + 10
            while busy.stats()["counters"]["ram_checks"] == checks:
                assert time.monotonic() < deadline, f"served from staging slot {slots} with no scrub check"
                time.sleep(0.01)
            slots = fetch_all(busy, [other], m, packed)
        assert slots == [holder.welcome.ram_first_slot]
        stats = busy.stats()
    assert stats["counters"]["ram_evictions"] == 1 and stats["ram"]["held"] == 0


def test_release_of_a_ram_slot_counts_holds(tiny_pack: Path, tmp_path: Path) -> None:
    """Two READYs name one RAM slot: it is released twice; a third release, or a release by a
    client that holds nothing there, is refused and changes nothing."""
    key = ExpertKey(0, 1)
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d, raw_session(d.endpoint) as (sock, welcome):
        sock.send(p.encode(p.Fetch(1, (key, key))))
        first, second = recv(sock), recv(sock)
        assert isinstance(first, p.Ready) and isinstance(second, p.Ready) and first.slot == second.slot
        assert first.slot >= welcome.ram_first_slot
        with ExpertClient(d.endpoint, name="bystander") as other:
            with pytest.raises(Exception, match="RAM slot .* listed 1 times, this client holds it 0"):
                other._sock.send(p.encode(p.Release((first.slot,))))
                other.ping()
            assert other.stats()["ram"]["held"] == 1
        sock.send(p.encode(p.Release((first.slot, first.slot, first.slot))))
        error = recv(sock)
        assert isinstance(error, p.Error) and "listed 3 times, this client holds it 2" in error.message
        sock.send(p.encode(p.Release((first.slot, first.slot))))
        sock.send(p.encode(p.Stats()))
        stats = recv(sock)
        assert isinstance(stats, p.StatsReply) and stats.stats["ram"]["held"] == 0


def test_a_corrupt_block_is_never_made_resident(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    bad = ExpertKey(1, 5)
    flip_byte(pack, bad)
    with ram_daemon(pack, tmp_path, "--ram-cache-gib", "1") as d, ExpertClient(d.endpoint) as client:
        for attempt in (1, 2):  # read, checked and refused each time: never served from RAM
            with pytest.raises(FetchFailed) as failed:
                list(client.fetch([bad]))
            assert failed.value.code is p.FailCode.CORRUPT
            stats = client.stats()
            assert stats["counters"]["corrupt_blocks"] == attempt and stats["ram"]["resident"] == 0
            assert stats["counters"]["ram_hits"] == 0


def test_no_ram_tier_serves_from_staging(tiny_pack: Path, tmp_path: Path) -> None:
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    keys = all_keys(m)[:20]
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "0") as d, ExpertClient(d.endpoint) as client:
        assert (client.welcome.ram_slots, client.welcome.shm_bytes) == (0, 32 * client.welcome.slot_bytes)
        for _ in range(2):
            assert set(fetch_all(client, keys, m, packed)) <= set(client.slots)
        stats = client.stats()
    c = stats["counters"]
    assert c["pack_read_bytes"] == 2 * len(keys) * m.max_stride
    assert (c["ram_hits"], c["ram_misses"], c["ram_evictions"]) == (0, 2 * len(keys), 0)
    assert stats["ram"]["slots"] == 0 and stats["ram"]["resident_bytes"] == 0


def test_a_bad_ram_cache_gib_in_the_file_is_one_line_and_exit_2(tiny_pack: Path, tmp_path: Path) -> None:
    """(Bad --ram-cache-gib flags are rows of tests/reliability/test_bad_input_table.py.)"""
    config = tmp_path / "expertd.toml"
    config.write_text(f'pack = "{tiny_pack}"\nendpoint = "ipc://{tmp_path}/s.sock"\nram_cache_gib = "lots"\n')
    proc = subprocess.run([str(BIN / "expertd"), "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc
    assert "ram_cache_gib: expected float, got 'lots'" in proc.stderr


def test_the_default_tier_is_sized_from_the_host_and_capped_by_the_pack(tiny_pack: Path, tmp_path: Path) -> None:
    m = Manifest.load(tiny_pack)
    # start_daemon gives --ram-cache-gib 0 unless told otherwise: this one runs without the flag.
    sock = tmp_path / "default.sock"
    proc = subprocess.Popen([str(BIN / "expertd"), "--pack", str(tiny_pack), "--endpoint", f"ipc://{sock}",
                             "--stage-slots", "8", "--client-slots", "4"], stderr=subprocess.PIPE, text=True)
    try:
        with ExpertClient(f"ipc://{sock}", timeout_s=20) as client:
            stats = client.stats()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    ram = stats["ram"]
    assert "capped at the whole pack" in ram["budget"] and "default" in ram["budget"]  # this host has the room
    assert ram["slots"] == len(all_keys(m)) and stats["config"]["ram_cache_gib"] is None


def test_stats_and_expertctl_show_the_tier(tiny_pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint) as client:
            for expert in client.fetch([(0, 0), (0, 1)]):
                expert.release()
            for expert in client.fetch([(0, 0)]):
                expert.release()
        assert expertctl_main(["stats", "--endpoint", d.endpoint, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert expertctl_main(["stats", "--endpoint", d.endpoint]) == 0
        table = capsys.readouterr().out
    c, ram = stats["counters"], stats["ram"]
    assert (c["ram_hits"], c["ram_misses"], c["ram_evictions"]) == (1, 2, 0)
    assert {"slots", "first_slot", "size_bytes", "resident_bytes", "held", "locked", "lock_error", "hits", "misses",
            "evictions", "empty", "reading", "resident", "budget"} <= set(ram)
    assert ram["resident"] == 2 and ram["resident_bytes"] == 2 * Manifest.load(tiny_pack).layer(0).payload_bytes
    line = next(li for li in table.splitlines() if li.startswith("ram "))
    assert "2 resident" in line and "hits 1" in line and "misses 2" in line and "evictions 0" in line, line


def test_a_tier_the_memlock_limit_cannot_lock_is_served_unlocked_and_said_so(tiny_pack: Path, tmp_path: Path) -> None:
    """In a user namespace (no CAP_IPC_LOCK there, even for its root) with a memlock limit that
    locks the staging but not the tier: expertd logs it once, serves, and STATS says so."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    m = Manifest.load(tiny_pack)
    staging = 32 * m.max_stride
    limit_kib = (staging + 2 * m.max_stride) // 1024  # the staging and two RAM slots, not the whole tier
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if hard != resource.RLIM_INFINITY and hard < limit_kib * 1024:
        pytest.skip(f"the memlock hard limit ({hard}) is below the staging's needs")
    sock = tmp_path / "s.sock"
    argv = ["unshare", "-r", "sh", "-c", f"ulimit -l {limit_kib} && exec \"$@\"", "sh", str(BIN / "expertd"),
            "--pack", str(tiny_pack), "--endpoint", f"ipc://{sock}", "--stage-slots", "32", "--client-slots", "8",
            "--ram-cache-gib", "1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        with ExpertClient(f"ipc://{sock}", timeout_s=20) as client:
            expert = next(client.fetch([(2, 2)]))
            assert expert.slot >= client.welcome.ram_first_slot
            expert.release()
            stats = client.stats()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert stats["ram"]["locked"] is False and stats["ram"]["lock_error"], stats["ram"]
    assert err.count("is not locked in memory") == 1 and "LimitMEMLOCK" in err, err


def test_a_demand_key_joining_a_prefetch_read_is_not_kept_behind_prefetches(tiny_pack: Path, tmp_path: Path) -> None:
    """One reader thread, 32 prefetch reads into the tier queued (8 pieces each); a demand for the
    last of them joins that read, which moves ahead of the other prefetches."""
    m = Manifest.load(tiny_pack)
    d = start_daemon(tiny_pack, tmp_path, "--read-threads", "1", "--read-splits", "8", "--stage-slots", "32",
                     "--client-slots", "32", "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    try:
        with raw_session(d.endpoint) as (sock, welcome):
            prefetch = all_keys(m)  # 64 keys: the first 32 are read into the tier at once (its share)
            sock.send(p.encode(p.Fetch(1, tuple(prefetch), p.Priority.PREFETCH)))
            sock.send(p.encode(p.Fetch(2, (prefetch[31],), p.Priority.DEMAND)))
            order = []
            while len(order) < len(prefetch) + 1:
                msg = recv(sock)
                assert isinstance(msg, p.Ready), msg
                assert msg.slot >= welcome.ram_first_slot
                order.append(msg.id)
                sock.send(p.encode(p.Release((msg.slot,))))
            sock.send(p.encode(p.Stats()))
            stats = recv(sock)
        assert isinstance(stats, p.StatsReply) and stats.stats["counters"]["ram_misses"] == len(prefetch)
        demand_at = order.index(2)
        assert demand_at < 8, f"demand key answered {demand_at + 1}th of {len(order)}"
    finally:
        assert d.stop()[0] == 0


def test_cancel_over_the_tier_answers_every_key_once(tiny_pack: Path, tmp_path: Path) -> None:
    """Keys answered from RAM, keys joining a read and keys read into the tier: after a CANCEL each
    is answered exactly once, and the reads already issued still make their blocks resident."""
    m = Manifest.load(tiny_pack)
    keys = tuple(all_keys(m))
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d, raw_session(d.endpoint) as (sock, welcome):
        sock.send(p.encode(p.Fetch(1, keys[:4])))
        warm = [recv(sock) for _ in range(4)]
        sock.send(p.encode(p.Release(tuple(r.slot for r in warm))))
        sock.send(p.encode(p.Fetch(7, keys + keys[:4], p.Priority.PREFETCH)))  # 4 hits, then misses
        first = recv(sock)
        sock.send(p.encode(p.Cancel(7)))
        answers = [first]
        while len(answers) < len(keys) + 4:
            answers.append(recv(sock))
        ready = [a for a in answers if isinstance(a, p.Ready)]
        failed = [a for a in answers if isinstance(a, p.Fail)]
        assert all(f.code is p.FailCode.CANCELLED for f in failed) and len(ready) >= 4
        assert sorted(a.key for a in answers) == sorted(keys + keys[:4])
        sock.send(p.encode(p.Ping()))
        assert isinstance(recv(sock), p.Pong)  # nothing more was queued behind the pong
        sock.send(p.encode(p.Release(tuple(r.slot for r in ready))))
        sock.send(p.encode(p.Stats()))
        stats = recv(sock).stats
    assert stats["ram"]["held"] == 0 and stats["ram"]["reading"] == 0
    assert stats["ram"]["resident"] == stats["counters"]["ram_misses"]  # cancelled or not, every read stays


def test_a_client_that_goes_away_ends_its_holds(tiny_pack: Path, tmp_path: Path) -> None:
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint, name="leaver") as leaver:
            kept = [e for e in leaver.fetch([(0, 0), (1, 1), (1, 1)])]  # never released
            assert len({e.slot for e in kept}) == 2 and all(e.slot >= leaver.welcome.ram_first_slot for e in kept)
            assert leaver.stats()["ram"]["held"] == 2
        with ExpertClient(d.endpoint, name="observer") as observer:
            held = observer.stats()["ram"]["held"]
            for _ in range(100):
                if not held:
                    break
                time.sleep(0.05)
                held = observer.stats()["ram"]["held"]
    assert held == 0


def test_clients_racing_over_a_small_tier_get_exact_bytes_and_leave_it_clean(tiny_pack: Path, tmp_path: Path) -> None:
    """Four clients, skewed random keys (hits, joins, admissions, evictions, refusals all happen),
    some fetches abandoned half way (CANCEL), some experts kept a while: every payload is the pack's,
    the daemon never logs a traceback, and once they are gone nothing is held or being read."""
    import random
    import threading

    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    keys = all_keys(m)
    weights = [1 / (i + 1) for i in range(len(keys))]
    errors: list[BaseException] = []

    def client_loop(seed: int, endpoint: str) -> None:
        rng = random.Random(seed)
        try:
            with ExpertClient(endpoint, name=f"racer{seed}", timeout_s=20) as client:
                kept: list = []
                for _ in range(40):
                    wanted = rng.choices(keys, weights, k=rng.randint(1, 6))
                    stream = client.fetch(wanted, prio=rng.choice(list(p.Priority)))
                    for i, expert in enumerate(stream):
                        assert bytes(expert.data) == payload(packed, m, expert.key), expert
                        if rng.random() < 0.3 and len(kept) < 2:
                            kept.append(expert)
                        else:
                            expert.release()
                        if rng.random() < 0.1:
                            stream.close()  # abandon the rest: CANCEL
                            break
                    if kept and rng.random() < 0.5:
                        kept.pop(0).release()
                for expert in kept:
                    assert bytes(expert.data) == payload(packed, m, expert.key), expert  # still intact
                    expert.release()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", gib_for(6, tiny_pack), "--read-splits", "2",
                    "--max-client-slots", "32") as d:  # four clients of this one process
        threads = [threading.Thread(target=client_loop, args=(s, d.endpoint)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        with ExpertClient(d.endpoint, name="after") as client:
            stats = client.stats()
            for _ in range(100):
                if not stats["ram"]["held"] and not stats["ram"]["reading"] and not stats["slots"]["reading"]:
                    break
                time.sleep(0.05)
                stats = client.stats()
        log = d.log
    c, ram = stats["counters"], stats["ram"]
    assert ram["held"] == 0 and ram["reading"] == 0 and ram["resident"] == 6
    assert c["ram_hits"] > 0 and c["ram_evictions"] > 0 and c["io_errors"] == 0 and c["corrupt_blocks"] == 0
    assert c["pack_read_bytes"] == c["ram_misses"] * m.max_stride  # every miss read once, whole
    assert "Traceback" not in log and "IllegalTransition" not in log


def client_line(sock) -> dict:
    """This raw client's line of STATS (the next message must be the reply)."""
    sock.send(p.encode(p.Stats()))
    reply = recv(sock)
    assert isinstance(reply, p.StatsReply), f"{reply} came before the STATS reply"
    (line,) = reply.stats["clients"]
    return line


def test_the_hold_share_is_apart_from_the_staging_and_prefetches_take_half_of_it(tiny_pack: Path,
                                                                                   tmp_path: Path) -> None:
    """v6: a client of 4 staging slots may hold 12 RAM blocks (client_ram_holds), WELCOME says so.
    Of 16 keys prefetched and never released, 6 (half) are answered and the rest wait in expertd;
    demand then gets the other half, 6 keys, and a seventh only once the client releases one."""
    keys = all_keys(Manifest.load(tiny_pack))
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "32", "--client-slots", "4", "--client-ram-holds", "12",
                     "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    try:
        with raw_session(d.endpoint) as (sock, welcome):
            assert len(welcome.slots) == 4 and welcome.ram_holds == 12
            sock.send(p.encode(p.Fetch(1, tuple(keys[:16]), p.Priority.PREFETCH)))
            prefetched = [recv(sock) for _ in range(6)]
            assert all(isinstance(r, p.Ready) and r.slot >= welcome.ram_first_slot for r in prefetched), prefetched
            line = client_line(sock)
            assert (line["ram_held"], line["ram_share"], line["queued_prefetch"]) == (6, 12, 10), line
            sock.send(p.encode(p.Fetch(2, tuple(keys[16:22]))))
            demanded = [recv(sock) for _ in range(6)]
            assert all(isinstance(r, p.Ready) and r.id == 2 for r in demanded), demanded
            sock.send(p.encode(p.Fetch(3, (keys[22],))))
            line = client_line(sock)
            assert (line["ram_held"], line["queued_demand"]) == (12, 1), line  # its share is held
            sock.send(p.encode(p.Release((demanded[0].slot,))))
            last = recv(sock)
            assert isinstance(last, p.Ready) and last.id == 3  # demand before the prefetches waiting
            held = [r.slot for r in prefetched + demanded[1:] + [last]]
            answered = 0
            while answered < 10:  # the prefetches left come as the client releases
                sock.send(p.encode(p.Release((held.pop(),))))
                while sock.poll(200):
                    msg = recv(sock)
                    assert isinstance(msg, p.Ready) and msg.id == 1, msg
                    held.append(msg.slot)
                    answered += 1
            sock.send(p.encode(p.Release(tuple(held))))
            line = client_line(sock)
            assert (line["ram_held"], line["queued"], line["requests"]) == (0, 0, 0), line
    finally:
        assert d.stop()[0] == 0


def test_kept_holds_leave_the_fetches_their_room_within_the_keep_share(tiny_pack: Path, tmp_path: Path) -> None:
    """v8: a client of 12 holds whose 12 blocks are held waits for a thirteenth; KEEP of 5 of them
    lets it on at once (kept holds count against ram_keeps, 5 here, not against the holds). A KEEP
    past the keep share, of a slot it does not hold unkept, or of a staging slot is refused and
    changes nothing; RELEASE ends unkept holds before kept ones; a client that goes away ends its
    kept holds like any other."""
    keys = all_keys(Manifest.load(tiny_pack))
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "32", "--client-slots", "4", "--client-ram-holds", "12",
                     "--client-ram-keeps", "5", "--ram-cache-gib", "1")
    d.wait_for("READY=1")
    try:
        with raw_session(d.endpoint) as (sock, welcome):
            assert (welcome.ram_holds, welcome.ram_keeps) == (12, 5)
            sock.send(p.encode(p.Fetch(1, tuple(keys[:12]))))
            held = [recv(sock) for _ in range(12)]
            assert all(isinstance(r, p.Ready) and r.slot >= welcome.ram_first_slot for r in held), held
            sock.send(p.encode(p.Fetch(2, (keys[12],))))
            assert client_line(sock)["queued_demand"] == 1  # its holds are all taken
            sock.send(p.encode(p.Keep(tuple(r.slot for r in held[:5]))))
            late = recv(sock)
            assert isinstance(late, p.Ready) and late.id == 2, late
            line = client_line(sock)
            assert (line["ram_held"], line["ram_kept"], line["ram_keeps"], line["queued"]) == (13, 5, 5, 0), line
            for refused, why in (((held[5].slot,), "at most 5"), ((held[0].slot,), "1 of them kept"),
                                 ((welcome.slots[0],), "not a RAM tier slot")):
                sock.send(p.encode(p.Keep(refused)))
                error = recv(sock)
                assert isinstance(error, p.Error) and error.code is p.ErrorCode.BAD_FIELD and why in error.message, error
            assert client_line(sock)["ram_kept"] == 5  # nothing changed
            sock.send(p.encode(p.Release((held[0].slot,))))  # its one hold there, kept
            sock.send(p.encode(p.Fetch(3, (held[1].key,))))  # a kept block held again, unkept
            again = recv(sock)
            assert isinstance(again, p.Ready) and again.slot == held[1].slot, again
            sock.send(p.encode(p.Release((again.slot,))))  # ends the unkept hold, not the kept one
            line = client_line(sock)
            assert (line["ram_held"], line["ram_kept"]) == (12, 4), line
        with raw_session(d.endpoint) as (sock, _):  # the first client went away with its 4 kept holds
            sock.send(p.encode(p.Stats()))
            reply = recv(sock)
            assert isinstance(reply, p.StatsReply) and reply.stats["ram"]["held"] == 0, reply.stats["ram"]
    finally:
        assert d.stop()[0] == 0


def test_prefetches_take_half_the_staging_where_there_is_no_tier(tiny_pack: Path, tmp_path: Path) -> None:
    """With no RAM tier, of 8 keys prefetched into a client's 4 staging slots 2 are read; demand
    for 2 more is read at once, into the other two."""
    keys = all_keys(Manifest.load(tiny_pack))
    d = start_daemon(tiny_pack, tmp_path, "--stage-slots", "32", "--client-slots", "4", "--ram-cache-gib", "0")
    d.wait_for("READY=1")
    try:
        with raw_session(d.endpoint) as (sock, welcome):
            assert welcome.ram_slots == welcome.ram_holds == 0
            sock.send(p.encode(p.Fetch(1, tuple(keys[:8]), p.Priority.PREFETCH)))
            prefetched = [recv(sock) for _ in range(2)]
            line = client_line(sock)
            assert (line["free"], line["queued_prefetch"]) == (2, 6), line
            sock.send(p.encode(p.Fetch(2, tuple(keys[8:10]))))
            demanded = [recv(sock) for _ in range(2)]
            assert all(isinstance(r, p.Ready) and r.id == 2 for r in demanded), demanded
            assert client_line(sock)["free"] == 0
            sock.send(p.encode(p.Cancel(1)))
            sock.send(p.encode(p.Release(tuple(r.slot for r in prefetched + demanded))))
            cancelled = [recv(sock) for _ in range(6)]
            assert all(isinstance(f, p.Fail) and f.code is p.FailCode.CANCELLED for f in cancelled), cancelled
            line = client_line(sock)
            assert (line["free"], line["queued"]) == (4, 0), line
    finally:
        assert d.stop()[0] == 0


def test_the_hold_share_defaults_to_256_at_most_half_the_tier_at_least_the_staging() -> None:
    from expertpack.daemon.config import DaemonConfig

    config = DaemonConfig()
    assert config.client_ram_holds == 256
    assert config.ram_hold_share(16, 1536) == 256
    assert config.ram_hold_share(16, 100) == 50
    assert config.ram_hold_share(16, 10) == 16
    assert config.ram_hold_share(16, 0) == 0  # no tier


def test_the_keep_share_defaults_to_the_tier_less_the_hold_share() -> None:
    """v8: one worker alone may keep every block its holds leave (its VRAM cache's complement, on a
    machine whose RAM holds the model); a setting lowers it, never raises it past that; a client's
    other sessions' keeps count against it."""
    from expertpack.daemon.config import DaemonConfig

    assert DaemonConfig().ram_keep_share(1536, 256) == 1280
    assert DaemonConfig(client_ram_keeps=100).ram_keep_share(1536, 256) == 100
    assert DaemonConfig(client_ram_keeps=5000).ram_keep_share(1536, 256) == 1280
    assert DaemonConfig().ram_keep_share(1536, 256, others=1000) == 280
    assert DaemonConfig().ram_keep_share(0, 0) == 0  # no tier


def test_clients_that_release_and_vanish_leave_no_holds_behind(tiny_pack: Path, tmp_path: Path) -> None:
    """Issue 37: a client holds its share of a resident tier with more RAM hits queued, RELEASEs
    them all and closes its socket at once. Answering its next hit finds it unreachable and ends
    its session; no hold may be added for that session after that (they pinned the whole tier with
    nobody connected). Once the clients are gone the tier holds nothing and serves a new one from RAM."""
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    keys = tuple(all_keys(m))
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint, name="warm") as client:
            fetch_all(client, list(keys), m, packed)  # every block resident
        with zmq.Context() as ctx:
            deadline = time.monotonic() + 6
            rounds = 0
            while time.monotonic() < deadline and rounds < 100:
                with ctx.socket(zmq.DEALER) as sock:
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(d.endpoint)
                    sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "vanisher", slots=1)))
                    welcome = recv(sock)
                    if isinstance(welcome, p.Error) and welcome.code is p.ErrorCode.NO_SLOTS:
                        time.sleep(0.01)  # closed sockets whose disconnect expertd has not seen yet
                        continue
                    assert isinstance(welcome, p.Welcome) and welcome.ram_holds < len(keys), welcome
                    sock.send(p.encode(p.Fetch(1, keys)))  # its share answered, the rest queued behind it
                    ready = [recv(sock) for _ in range(welcome.ram_holds)]
                    sock.send(p.encode(p.Release(tuple(r.slot for r in ready))))
                rounds += 1
        with ExpertClient(d.endpoint, name="after") as client:
            stats = client.stats()
            for _ in range(100):
                if not stats["ram"]["held"] and len(stats["clients"]) == 1:
                    break
                time.sleep(0.05)
                stats = client.stats()
            assert stats["ram"]["held"] == 0, f"{stats['ram']['held']} tier blocks held after {rounds} rounds"
            before = stats["counters"]
            fetch_all(client, list(keys), m, packed)
            after = client.stats()["counters"]
    assert after["pack_read_bytes"] == before["pack_read_bytes"]  # all from RAM: nothing was pinned away
    assert after["ram_hits"] - before["ram_hits"] == len(keys)


def test_the_scrub_rests_while_no_client_is_connected(tiny_pack: Path, tmp_path: Path) -> None:
    """An expertd nobody uses checks nothing (no reader work, no wake-ups for the scrub); it starts
    again as soon as a client holds a session."""
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)

    def checks(sock: zmq.Socket) -> int:
        sock.send(p.encode(p.Stats()))
        assert sock.poll(5000)
        reply = p.decode(sock.recv())
        assert isinstance(reply, p.StatsReply)
        return reply.stats["counters"]["ram_checks"]

    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d:
        with ExpertClient(d.endpoint, name="filler") as client:
            fetch_all(client, all_keys(m)[:8], m, packed)
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as probe:  # STATS needs no session
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(d.endpoint)
            time.sleep(0.3)  # a check under way when the client left completes
            idle = checks(probe)
            time.sleep(1.5)
            assert checks(probe) == idle, "the scrub ran with no client connected"
            with raw_session(d.endpoint):
                deadline = time.monotonic() + 10
                while checks(probe) == idle:
                    assert time.monotonic() < deadline, "the scrub did not start again with a client connected"
                    time.sleep(0.05)


def test_a_client_keeping_a_block_the_scrub_condemns_is_told(tiny_pack: Path, tmp_path: Path) -> None:
    """v8: a kept block is read by the client's GPU past any check of expertd's, so when the scrub
    finds it altered, expertd tells the client that keeps it (CONDEMNED, unasked) and no other;
    once released, the key is read again from the pack."""
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    key = ExpertKey(2, 7)
    # raw sessions send no HEARTBEAT: on a loaded machine the scrub may take longer than the default timeout
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1", "--heartbeat-timeout-s", "120") as d:
        with raw_session(d.endpoint) as (keeper, w), raw_session(d.endpoint) as (other, _):
            keeper.send(p.encode(p.Fetch(1, (key,))))
            other.send(p.encode(p.Fetch(1, (key,))))
            ready, other_ready = recv(keeper), recv(other)
            assert isinstance(ready, p.Ready) and isinstance(other_ready, p.Ready) and ready.slot == other_ready.slot
            keeper.send(p.encode(p.Keep((ready.slot,))))
            alter_in_memory(w, [(ready.slot, m.layer(key.layer).payload_bytes)])
            assert keeper.poll(60_000), "the scrub did not condemn the kept block in 60 s"
            told = recv(keeper)
            assert told == p.Condemned((ready.slot,)), told
            assert not other.poll(500)  # it holds the block, but does not keep it: nothing unasked
            other.send(p.encode(p.Release((other_ready.slot,))))
            keeper.send(p.encode(p.Release((ready.slot,))))
        with ExpertClient(d.endpoint, name="after") as client:
            before = client.stats()["counters"]
            fetch_all(client, [key], m, packed)  # the pack's bytes, read again
            after = client.stats()["counters"]
    assert after["corrupt_blocks"] == 1 and after["pack_read_bytes"] - before["pack_read_bytes"] == m.max_stride


def test_a_keep_of_a_block_the_scrub_condemned_already_is_told_at_once(tiny_pack: Path, tmp_path: Path) -> None:
    """The race CI met: the scrub's check of a block completes before expertd reads the KEEP that a
    client sent for it (its READY came first). Nobody kept it when it was condemned, so the KEEP
    itself is answered with CONDEMNED: else the client's GPU would read the altered bytes for good."""
    m = Manifest.load(tiny_pack)
    key = ExpertKey(2, 7)
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1", "--heartbeat-timeout-s", "120") as d:
        with raw_session(d.endpoint) as (keeper, w):
            keeper.send(p.encode(p.Fetch(1, (key,))))
            ready = recv(keeper)
            assert isinstance(ready, p.Ready)
            alter_in_memory(w, [(ready.slot, m.layer(key.layer).payload_bytes)])
            deadline = time.monotonic() + 60
            while True:
                keeper.send(p.encode(p.Stats()))
                stats = recv(keeper)
                assert isinstance(stats, p.StatsReply)
                if stats.stats["counters"]["corrupt_blocks"]:
                    break
                assert time.monotonic() < deadline, "the scrub did not find the altered block in 60 s"
                time.sleep(0.05)
            keeper.send(p.encode(p.Keep((ready.slot,))))
            assert keeper.poll(10_000), "a KEEP of a condemned block was not answered"
            assert recv(keeper) == p.Condemned((ready.slot,))
            keeper.send(p.encode(p.Release((ready.slot,))))
            keeper.send(p.encode(p.Ping()))
            assert isinstance(recv(keeper), p.Pong)


def test_telling_the_keepers_goes_on_past_a_keeper_dropped_meanwhile() -> None:
    """A CONDEMNED that cannot be sent (the keeper gone: EHOSTUNREACH; not reading: EAGAIN) drops
    that keeper's session while expertd walks the keepers: the others are still told, and the walk
    does not fail (it did: the live sessions changed size under it, and expertd stopped)."""
    from collections import Counter, deque
    from types import SimpleNamespace

    from expertpack.daemon.server import ExpertDaemon
    from expertpack.daemon.sessions import Session

    live = {name: Session(name, 3, name.decode(), [], deque(), ram_kept=Counter({5: 1})) for name in (b"gone", b"here")}
    live[b"other"] = Session(b"other", 4, "other", [], deque())  # keeps nothing
    told = []

    def send(identity: bytes, msg: p.Message) -> None:
        if identity == b"gone":  # as _send does when the router refuses it
            live.pop(identity).closed = True
            return
        told.append((identity, msg))

    ExpertDaemon._tell_keepers(SimpleNamespace(sessions=SimpleNamespace(live=live), _send=send), 5)
    assert told == [(b"here", p.Condemned((5,)))] and set(live) == {b"here", b"other"}


def test_the_scrub_finds_a_tier_block_altered_in_memory_and_it_is_read_again(tiny_pack: Path, tmp_path: Path) -> None:
    """Issue 37: the client library maps the segment read-only, but a process of expertd's own user
    can still open it writable and alter a resident block. expertd's scrub checks resident blocks
    against their crc32 while it reads nothing: the altered block is counted in corrupt_blocks,
    leaves the tier (at once, or when the client that holds it releases it) and is read again from
    the pack, so every client gets the pack's bytes from then on."""
    m = Manifest.load(tiny_pack)
    packed = np.fromfile(tiny_pack / PACK_FILE, dtype=np.uint8)
    key, held_key = ExpertKey(2, 7), ExpertKey(3, 1)
    with ram_daemon(tiny_pack, tmp_path, "--ram-cache-gib", "1") as d, \
            ExpertClient(d.endpoint, name="victim") as victim, ExpertClient(d.endpoint, name="holder") as holder:
        (slot,) = fetch_all(victim, [key], m, packed)
        held = next(holder.fetch([held_key]))  # held across the damage
        w = victim.welcome
        alter_in_memory(w, [(index, m.layer(k.layer).payload_bytes) for index, k in ((slot, key), (held.slot, held_key))])
        before = victim.stats()["counters"]
        deadline = time.monotonic() + 20
        while victim.stats()["counters"]["corrupt_blocks"] - before["corrupt_blocks"] < 2:
            assert time.monotonic() < deadline, "the scrub did not find the two altered blocks in 20 s"
            time.sleep(0.05)
        fetch_all(victim, [key, held_key], m, packed)  # the pack's bytes, read again
        stats = victim.stats()
        assert stats["counters"]["corrupt_blocks"] - before["corrupt_blocks"] == 2
        assert stats["counters"]["pack_read_bytes"] - before["pack_read_bytes"] == 2 * m.max_stride
        assert stats["ram"]["condemned"] == 1  # the altered block the holder still holds: never named again
        held.release()
        holder.ping()
        fetch_all(victim, [key, held_key], m, packed)  # resident again, intact: from RAM
        stats = victim.stats()
    c = stats["counters"]
    assert c["corrupt_blocks"] == 2 and c["pack_read_bytes"] - before["pack_read_bytes"] == 2 * m.max_stride
    assert stats["ram"]["condemned"] == 0 and stats["ram"]["held"] == 0
    assert c["ram_checks"] >= 2
