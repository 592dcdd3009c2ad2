"""ExpertClient.submit, the one-key FETCH sent without waiting (the worker's prefetches), against a
real expertd: it goes at PREFETCH priority; its answer is kept for it while other requests read the
socket and taken with result(), byte for byte the pack's; cancel() gives its slot back whether the
answer was in (released at once) or not (CANCEL, and the late answer released when it comes, which
`abandoned` counts until then); a Pending ends once; promote() (v5) sends PROMOTE once, and only
while the answer is not in, and expertd then reads a promoted key before the prefetches queued
ahead of it."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from expertpack.client import ClientError, ExpertClient
from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey, Manifest

from ..conftest import Daemon
from ..helpers.expertd import slots_back


def test_a_submit_is_a_prefetch_whose_answer_waits_for_it(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint) as client:
        sent: list[p.Message] = []
        send = client._send
        client._send = lambda msg: (sent.append(msg), send(msg))[1]
        key = ExpertKey(m.layers[1].layer, 3)
        pending = client.submit(key)
        assert sent == [p.Fetch(pending.request_id, (key,), p.Priority.PREFETCH)]
        other = ExpertKey(m.layers[0].layer, 5)
        for expert in client.fetch([other]):  # reading the socket for a demand keeps the prefetch's answer
            expert.release()
        expert = pending.result()
        assert expert.key == key and expert.nbytes == m.layer(key.layer).payload_bytes
        assert hashlib.sha256(expert.data).hexdigest() == m.layer(key.layer).sha256[key.expert]
        expert.release()
        with pytest.raises(ClientError, match="already taken or cancelled"):
            pending.result()
        assert client.abandoned == 0 and slots_back(client)


def test_cancel_gives_the_slot_back_answered_or_not(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint) as client:
        answered = client.submit((m.layers[0].layer, 1))
        deadline = time.monotonic() + 10
        while not answered.answered:
            assert time.monotonic() < deadline
            client.pump()
        unanswered = [client.submit((m.layers[1].layer, e)) for e in range(4)]  # nothing read since: not answered
        answered.cancel()
        assert client.abandoned == 0  # its READY was in: released at once
        for pending in unanswered:
            pending.cancel()
            pending.cancel()  # idempotent
        assert client.abandoned == 4
        client.settle()
        assert client.abandoned == 0 and slots_back(client)
        counters = client.stats()["counters"]
        assert counters["keys"] == 5 and counters["ready"] + counters["cancelled"] == 5


def test_a_promoted_prefetch_overtakes_the_prefetches_queued_before_it(tiny_pack: Path, tmp_path: Path) -> None:
    """Two staging slots, of which prefetches may take one (v6): the first of five prefetches is
    read, the other four wait in the client's queue. PROMOTE of the last moves it to the demand
    queue: it is read second, into the other slot, before the three sent ahead of it; the rest
    follow in order. Promoting an answered one sends nothing."""
    from ..conftest import start_daemon

    m = Manifest.load(tiny_pack)
    d = start_daemon(tiny_pack, tmp_path, "--client-slots", "2", "--ram-cache-gib", "0")
    try:
        d.wait_for("READY=1")
        with ExpertClient(d.endpoint) as client:
            sent: list[p.Message] = []
            put = client._put  # every message goes out through it
            client._put = lambda msg: (sent.append(msg), put(msg))[1]
            layer = m.layers[0].layer
            pendings = [client.submit((layer, e)) for e in range(5)]
            first = pendings[0].result()  # held: the prefetches' one slot stays taken
            assert not any(x.answered for x in pendings[1:])
            pendings[4].promote()
            pendings[4].promote()  # once is enough
            assert [msg for msg in sent if isinstance(msg, p.Promote)] == [p.Promote(pendings[4].request_id)]
            order = [first.key.expert]
            first.release()
            left = pendings[1:]
            deadline = time.monotonic() + 30
            while left:
                assert time.monotonic() < deadline
                client.pump()
                for pending in [x for x in left if x.answered]:  # one at a time: each is released first
                    order.append(pending.key.expert)
                    left.remove(pending)
                    pending.result().release()
            assert order == [0, 4, 1, 2, 3]
            pendings[4].promote()  # answered and taken: nothing to say
            assert sum(isinstance(msg, p.Promote) for msg in sent) == 1 and slots_back(client)
    finally:
        assert d.stop()[0] == 0
