"""Fixtures of the tests that serve over HTTP (test_expert_worker.py, test_api.py): a real expertd
and expert-worker on a fixture pack, and the in-process engine to hold their answers to. Module
scope: each module that takes them starts its own pair, once, and stops it after its last test."""

from __future__ import annotations

import pytest

from expertpack.worker.engine.engine import Engine
from expertpack.worker.serve.tokenizer import load_tokenizer

from ..conftest import start_daemon


@pytest.fixture(scope="module")
def served(fixture_packs, tmp_path_factory: pytest.TempPathFactory):
    # Here, not at the top: this folder's other modules are collected without openai or prometheus_client.
    from ..helpers.worker import PACK, start_worker

    pack = fixture_packs[PACK][1]
    tmp = tmp_path_factory.mktemp("served")
    daemon = start_daemon(pack, tmp, "--client-slots", "4")
    daemon.wait_for("READY=1")
    worker = start_worker(pack, daemon.endpoint, tmp)
    yield pack, daemon, worker
    assert worker.stop() == 0, worker.log
    assert "stopped" in worker.log and "Traceback" not in worker.log
    assert daemon.stop()[0] == 0


@pytest.fixture(scope="module")
def local(served) -> tuple[Engine, object]:
    engine = Engine.load(served[0])
    return engine, load_tokenizer(engine.files.metadata)
