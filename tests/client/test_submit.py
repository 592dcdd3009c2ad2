"""ExpertClient.submit, the one-key FETCH sent without waiting (the worker's prefetches), against a
real expertd: it goes at PREFETCH priority; its answer is kept for it while other requests read the
socket and taken with result(), byte for byte the pack's; cancel() gives its slot back whether the
answer was in (released at once) or not (CANCEL, and the late answer released when it comes, which
`abandoned` counts until then); a Pending ends once."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from expertpack.client import ClientError, ExpertClient
from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey, Manifest

from ..conftest import Daemon


def slots_back(client: ExpertClient) -> bool:
    """Whether expertd counts every slot of this client free (a PING first: it has handled what
    the client sent before it)."""
    client.ping()
    (session,) = [s for s in client.stats()["clients"] if s["slots"] == len(client.slots)]
    return session["free"] == session["slots"] and session["requests"] == 0


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
