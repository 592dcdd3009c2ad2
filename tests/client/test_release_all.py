"""release_all: the slots of many delivered experts go back in one RELEASE per session (a
streaming worker gives one back per miss), each expert once, and expertd counts them all free."""

from __future__ import annotations

from pathlib import Path

from expertpack.client import ExpertClient, release_all
from expertpack.client import protocol as p
from expertpack.packtools.layout import ExpertKey, Manifest

from ..conftest import Daemon
from ..helpers.expertd import slots_back


def test_release_all_gives_every_slot_back_in_one_release(daemon: Daemon, tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    with ExpertClient(daemon.endpoint) as client:
        sent: list[p.Message] = []
        send = client._send_if_alive
        client._send_if_alive = lambda msg: (sent.append(msg), send(msg))[1]
        n = min(3, len(client.slots))
        experts = list(client.fetch([ExpertKey(m.layers[0].layer, e) for e in range(n)]))
        experts[0].release()  # released already: not given back twice
        assert len(sent) == 1
        release_all(experts + experts[1:])  # each expert named twice: its slot goes back once
        assert len(sent) == 2 and isinstance(sent[1], p.Release)
        assert sorted(sent[1].slots) == sorted(e.slot for e in experts[1:])
        assert all(e.released for e in experts)
        release_all(experts)  # nothing left to give back: no message
        assert len(sent) == 2
        assert slots_back(client)
