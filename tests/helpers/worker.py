"""A real expert-worker process as the serving tests run it (its HTTP helpers, its /metrics read as
Prometheus would) and the in-process engine's greedy text to hold its answers to."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from expertpack.worker.engine.sampling import Sampler

from ..conftest import BIN, free_port

PACK = "qwen3moe-a.Q4_K_M"  # carries Qwen's chat template
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@dataclass
class Worker:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def start_worker(pack: Path, endpoint: str, tmp: Path, *extra: str, ready: str = "/health") -> Worker:
    port = free_port()
    log_path = tmp / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(BIN / "expert-worker"), "--pack", str(pack), "--daemon", endpoint, "--device",
                                 "cpu", "--port", str(port), "--model-name", "fixture", "--cache-vram-mib", "1", *extra],
                                stdout=log, stderr=log)
    w = Worker(proc, port, log_path)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"expert-worker exited {proc.returncode}: {w.log}")
        try:
            if w.get(ready)[0] == 200:
                return w
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"expert-worker never became healthy: {w.log}")
        time.sleep(0.2)


def served_context(worker: Worker) -> int:
    """The context the worker serves, from its "serving ..." log line."""
    return int(worker.log.split(", context ")[1].split(";")[0])


def open_stream(port: int, body: bytes, timeout: float) -> tuple[socket.socket, bytes]:
    """A streamed /v1/completions request over a raw socket (the test decides when its client
    leaves): the socket and what came until its first token (headers, then a data event)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data: " not in seen:
        piece = s.recv(4096)
        assert piece, "the stream ended before its first token"
        seen += piece
    return s, seen


def metric_values(worker: Worker) -> dict[str, float]:
    status, text = worker.get("/metrics")
    assert status == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def local_greedy(local, prompt_ids: list[int], n: int) -> str:
    engine, tokenizer = local
    tokens, _ = engine.generate(prompt_ids, n, Sampler(), stop=set(tokenizer.stop_ids))
    return tokenizer.decode(tokens)
