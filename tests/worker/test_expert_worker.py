"""expert-worker as users run it: a real expertd and a real expert-worker process on a fixture
model's pack, spoken to with the official `openai` client (nobody here wrote it):

- completions and chat, streamed and not, give the greedy text the in-process engine gives;
- usage carries the token counts, the rates, the hit rate and the bytes read;
- /metrics parses with prometheus_client's own parser and counts what happened;
- bad requests get OpenAI-style 400/404 errors and the server keeps serving;
- --max-body-mib and --max-prompt-chars hold at their edges (413, 400 naming the limit); /health
  answers while a prompt is being tokenized (in this process, with a tokenizer slowed down);
- the daemon killed during a generation: restarted, the request completes with the same text;
  left dead, the request fails with a clear 503 and the worker stays up and serves again once
  the daemon is back; SIGTERM stops the worker cleanly.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from expertpack.packtools.layout import Manifest
from expertpack.worker.experts.expert_cache import slot_bytes
from expertpack.worker.serve.chat_template import ChatTemplate

from ..conftest import BIN, Daemon, free_port, run_cli, start_daemon
from ..helpers.engine import damage_layer
from ..helpers.worker import CHAT, PACK, Worker, local_greedy, metric_values, served_context, start_worker


def local_chat_ids(local, messages) -> list[int]:
    engine, tokenizer = local
    text = ChatTemplate(engine.files.metadata).render(messages)
    return tokenizer.encode(text)


def test_completions_match_the_in_process_engine(served, local) -> None:
    _, _, worker = served
    client = worker.client()
    prompt = "The quick brown fox"
    want = local_greedy(local, local[1].encode(prompt), 12)
    got = client.completions.create(model="fixture", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.prompt_tokens == len(local[1].encode(prompt)) and got.usage.completion_tokens >= 1
    extra = got.model_extra
    assert extra["timings"]["prompt_per_second"] > 0 and extra["expertpack"]["fetched_bytes"] > 0
    assert 0 <= extra["expertpack"]["hit_rate"] <= 1

    pieces, finish = [], None
    for chunk in client.completions.create(model="fixture", prompt=prompt, max_tokens=12, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == want and finish == got.choices[0].finish_reason

    ids = local[1].encode(prompt)
    by_ids = client.completions.create(model="fixture", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want


def test_chat_matches_the_in_process_engine(served, local) -> None:
    _, _, worker = served
    client = worker.client()
    want = local_greedy(local, local_chat_ids(local, CHAT), 10)
    got = client.chat.completions.create(model="fixture", messages=CHAT, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want
    stream = client.chat.completions.create(model="fixture", messages=CHAT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_ignore_eos_gives_exactly_max_tokens_and_models_lists_the_model(served) -> None:
    _, _, worker = served
    client = worker.client()
    got = client.completions.create(model="fixture", prompt="a", max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 20 and got.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["fixture"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served) -> None:
    _, _, worker = served
    client = worker.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="fixture", prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 16"):
        client.chat.completions.create(model="fixture", messages=CHAT, n=17)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="fixture", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="fixture", prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="prompt token ids"):
        client.completions.create(model="fixture", prompt=[1, 10**7])
    status, body = worker.post("/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "messages": CHAT, "max_tokens": 2, "seed": 2**64}).encode())
    assert status == 400 and body["error"]["param"] == "seed", body
    ok = client.completions.create(model="fixture", prompt="still here", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_metrics_parse_and_count(served) -> None:
    _, _, worker = served
    client = worker.client()
    before = metric_values(worker)
    got = client.completions.create(model="fixture", prompt="count me", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metric_values(worker)
    assert after["expertpack_completion_tokens_total"] - before["expertpack_completion_tokens_total"] == 4
    assert after["expertpack_prompt_tokens_total"] - before["expertpack_prompt_tokens_total"] == got.usage.prompt_tokens
    looked = sum(after[k] - before[k] for k in ("expertpack_cache_hits_total", "expertpack_cache_misses_total"))
    assert looked > 0 and after["expertpack_cache_h2d_bytes_total"] > before["expertpack_cache_h2d_bytes_total"]
    assert after["expertpack_daemon_up"] == 1 and after["expertpack_daemon_read_bytes_total"] > 0
    assert "expertpack_daemon_refetched_keys_total" in after  # its value: tests/worker/test_expert_cache.py
    # The generation thread's parts: a prompt piece (its first token), then a step alone for each of 3 more.
    assert after["expertpack_decode_steps_total"] - before.get("expertpack_decode_steps_total", 0) == 3
    spent = after["expertpack_generation_thread_seconds_total"] - before["expertpack_generation_thread_seconds_total"]
    assert 0 < spent < 60
    m = Manifest.load(served[0])
    slots = min(len(m.layers) * m.model.n_expert, 2**20 // slot_bytes(m))
    assert after["expertpack_cache_slots"] == slots


def test_daemon_killed_during_a_generation(fixture_packs, local, tmp_path: Path) -> None:
    """The request in flight waits for a daemon (up to --daemon-down-timeout-s, 60 s by default)
    and gives the text of a clean run once one is back; a request that comes while the daemon is
    gone is answered 503 at once (it used to wait those 60 s too), as /health says."""
    pack = fixture_packs[PACK][1]
    for sub in ("a", "b", "c", "d"):
        (tmp_path / sub).mkdir()
    first = start_daemon(pack, tmp_path / "a")
    first.wait_for("READY=1")
    worker = start_worker(pack, first.endpoint, tmp_path / "a", "--daemon-timeout-s", "1")
    client = worker.client()
    prompt = "A long story begins"
    want = local_greedy(local, local[1].encode(prompt), 48)
    later: list[Daemon] = []

    def kill(daemon: Daemon) -> None:
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        for left in Path("/dev/shm").glob(f"expertpack-{daemon.proc.pid}-*"):  # what SIGKILL leaves
            left.unlink()

    def restart(sub: str) -> None:
        later.append(start_daemon(pack, tmp_path / sub, "--endpoint", first.endpoint))

    def refused_at_once() -> None:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="expert storage unavailable") as err:
            client.completions.create(model="fixture", prompt="a new request", max_tokens=8, temperature=0)
        assert err.value.status_code == 503 and err.value.body["code"] == "daemon_unavailable", err.value.body
        assert time.monotonic() - start < 10, "a new request waited for the daemon"
        assert worker.get("/health")[0] == 503 and worker.proc.poll() is None

    try:
        # Restarted soon after: the worker reconnects and the text is the text.
        pieces = []
        stream = client.completions.create(model="fixture", prompt=prompt, max_tokens=48, temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            pieces.append(chunk.choices[0].text)
            if i == 0:
                kill(first)
                threading.Timer(0.5, restart, ("b",)).start()
        assert "".join(pieces) == want
        assert "reconnected to expertd" in worker.log

        # Gone: a new request is refused at once, and the worker stays up.
        later[0].wait_for("READY=1")
        kill(later[0])
        refused_at_once()

        # Gone while a request is in flight: it waits and completes once a daemon is back; a new
        # request meanwhile is refused at once.
        restart("c")
        later[-1].wait_for("READY=1")
        stream = client.completions.create(model="fixture", prompt=prompt, max_tokens=48, temperature=0, stream=True)
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        kill(later[-1])
        refused_at_once()
        restart("d")
        pieces += [chunk.choices[0].text for chunk in chunks]
        assert "".join(pieces) == want
        assert worker.log.count("reconnected to expertd") == 3  # to b, to c, and the stream waited for d
        again = client.completions.create(model="fixture", prompt=prompt, max_tokens=48, temperature=0)
        assert again.choices[0].text == want
    finally:
        assert worker.stop() == 0, worker.log
        first.notify.close()
        for d in later:
            if d.proc.poll() is None:
                d.stop()
            else:
                d.notify.close()


def test_bench_serve_replays_the_protocol(served, tmp_path: Path) -> None:
    _, _, worker = served
    proc = run_cli("bench", "serve", "--endpoint", worker.url, "--max-tokens", "5", "--out", tmp_path,
                   "--label", "fixture on CPU", timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "bench-serve.json").read_text())
    assert report["model"] == "fixture" and len(report["requests"]) == 10
    assert all(r["completion_tokens"] == 5 and r["rates_from"] == "server" for r in report["requests"])
    for name in ("instruction", "multiple-choice"):
        s = report["summary"][name]
        assert s["requests"] == 5 and s["decode_tokens_per_s"] > 0 and 0 <= s["hit_rate"] <= 1
        assert s["fetched_gb_per_token"] is not None
        assert name in proc.stdout
    assert (tmp_path / "bench-serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    down = run_cli("bench", "serve", "--endpoint", "http://127.0.0.1:9", "--out", tmp_path)
    assert down.returncode == 2 and "is the server running" in down.stderr and "Traceback" not in down.stderr


def test_bench_serve_keeps_requests_in_flight(served, tmp_path: Path) -> None:
    """Three requests in flight (expert-worker generates them together, up to --max-batch): the
    bench counts every request's tokens and times its first token from its send."""
    _, _, worker = served
    proc = run_cli("bench", "serve", "--endpoint", worker.url, "--max-tokens", "3", "--concurrency", "3",
                   "--out", tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "bench-serve.json").read_text())
    assert report["concurrency"] == 3 and json.loads(proc.stdout.splitlines()[-1])["concurrency"] == 3
    header, *rows = proc.stdout.splitlines()[:3]
    assert "concurrency" in header and all(row.split()[1:3] == [name, "3"] for row, name in
                                           zip(rows, ("instruction", "multiple-choice"))), proc.stdout
    for name in ("instruction", "multiple-choice"):
        rs = [r for r in report["requests"] if r["set"] == name]
        assert sorted(r["index"] for r in rs) == list(range(5))
        assert all(r["completion_tokens"] == 3 and r["ttft_s"] > 0 and r["started_s"] >= 0 for r in rs)
        # Three sent before any answer came back: they were in flight together.
        first_answer = min(r["started_s"] + r["seconds"] for r in rs)
        assert sorted(r["started_s"] for r in rs)[2] < first_answer, rs
        s = report["summary"][name]
        assert s["completion_tokens"] == 15 and s["aggregate_decode_tokens_per_s"] > 0 and s["wall_s"] > 0
        assert 0 < s["ttft_s_p50"] <= s["ttft_s_p90"] and s["ttft_s_mean"] > 0 and s["decode_tokens_per_s_p90"] > 0


def test_a_prompt_beyond_the_context_is_refused_without_max_tokens(served) -> None:
    _, _, worker = served
    with pytest.raises(openai.BadRequestError, match="maximum context length") as err:
        worker.client().completions.create(model="fixture", prompt=[5] * 50_000)
    assert err.value.body["code"] == "context_length_exceeded"


def test_health_and_metrics_answer_during_a_generation_and_a_dropped_stream_stops(served) -> None:
    _, _, worker = served
    http = urllib.request.urlopen(urllib.request.Request(
        worker.url + "/v1/completions", json.dumps({"model": "fixture", "prompt": "on and on", "max_tokens": 3000,
                                                     "temperature": 0, "ignore_eos": True, "stream": True}).encode(),
        {"Content-Type": "application/json"}), timeout=60)
    for _ in range(3):
        assert http.readline().startswith(b"data:") and http.readline() == b"\n"
    # The generation thread is busy: the event loop and the daemon link still answer.
    assert worker.get("/health")[0] == 200
    status, text = worker.get("/metrics")
    assert status == 200 and "expertpack_daemon_up 1" in text
    http.close()  # the client goes away mid-stream
    client = worker.client()
    done = client.completions.create(model="fixture", prompt="next", max_tokens=2, temperature=0)
    assert done.usage.completion_tokens >= 1
    deadline = time.monotonic() + 60
    while "/v1/completions 499:" not in worker.log and time.monotonic() < deadline:
        time.sleep(0.1)
    dropped = [line for line in worker.log.splitlines() if "/v1/completions 499:" in line]
    assert dropped, "the abandoned stream was never accounted for"
    assert int(dropped[-1].split(" + ")[1].split()[0]) < 3000, f"the abandoned stream ran on: {dropped[-1]}"


@pytest.mark.parametrize("args,needle", [
    (("--device", "bogus"), "--device 'bogus': expected cpu, cuda or cuda:N"),
    (("--device", "cuda:99"), "--device cuda:99"),
    (("--device", "meta"), "runs on cpu or cuda"),
    (("--device", "cpu,cuda:0"), "--device 'cpu,cuda:0': mixes cpu and cuda"),
    (("--device", "cuda:0,cuda:0"), "--device cuda:0,cuda:0"),
    (("--device", "cuda:0,,cuda:1"), "expected cpu, cuda or cuda:N"),
    (("--device", "cuda:999999999999999999999"), "--device 'cuda:999999999999999999999': no such device"),
    (("--daemon-timeout-s", "inf"), "daemon_timeout_s: must lie in"),
    (("--daemon-down-timeout-s", "nan"), "daemon_down_timeout_s: must lie in"),
    (("--cache-vram-mib", "-5"), "cache_vram_mib: must lie in"),
    (("--port", "70000"), "port: must lie in 1..65,535"),
    (("--log-level", "loud"), "log_level"),
])
def test_bad_settings_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    proc = subprocess.run([str(BIN / "expert-worker"), "--pack", str(tmp_path / "no-pack"), "--daemon",
                           f"ipc://{tmp_path}/none.sock", *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0], lines


def test_bad_config_file_values_are_one_line(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('pack = "/nowhere"\nport = "eighty"\ncache_vram_mib = 1.5\n')
    proc = subprocess.run([str(BIN / "expert-worker"), "--config", str(config)], capture_output=True, text=True,
                          timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "port: expected int, got 'eighty'" in lines[0] and "cache_vram_mib: expected int" in lines[0]


def test_a_port_already_taken_is_refused_before_loading(served, tmp_path: Path) -> None:
    pack, daemon, _ = served
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([str(BIN / "expert-worker"), "--pack", str(pack), "--daemon", daemon.endpoint,
                               "--device", "cpu", "--port", str(port), "--cache-vram-mib", "1"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Address already in use" in proc.stderr
    assert "serving" not in proc.stderr and "Traceback" not in proc.stderr


def test_health_tells_the_daemon_as_it_is_now(fixture_packs, tmp_path: Path) -> None:
    """expertd killed while a generation waits for it: /health says unreachable within seconds (it
    used to answer from memory while the fetch held the link); back when a daemon is; degraded
    when the pack is truncated under the daemon; 503 naming both packs when a daemon restarted on
    the endpoint serves another pack (every request then fails: it used to say 200)."""
    import shutil

    pack = tmp_path / "pack"
    shutil.copytree(fixture_packs[PACK][1], pack)
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    first = start_daemon(pack, tmp_path / "a")
    first.wait_for("READY=1")
    worker = start_worker(pack, first.endpoint, tmp_path / "a", "--daemon-timeout-s", "1",
                          "--daemon-down-timeout-s", "60")
    later: list[Daemon] = []
    try:
        assert worker.get("/health") == (200, json.dumps({"status": "ok", "daemon": "up"}, separators=(",", ":")))
        stream = worker.client().completions.create(model="fixture", prompt="Once upon a time", max_tokens=400,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        start = time.monotonic()
        status, body = worker.get("/health")  # the generation is retrying its fetch meanwhile
        assert (status, json.loads(body)["daemon"]) == (503, "unreachable"), body
        assert time.monotonic() - start < 10
        later.append(start_daemon(pack, tmp_path / "b", "--endpoint", first.endpoint))
        later[0].wait_for("READY=1")
        assert sum(1 for _ in chunks) > 0  # the generation resumes on the new daemon
        assert worker.get("/health")[0] == 200
        with open(pack / "experts.pack", "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        status, body = worker.get("/health")
        assert status == 503 and json.loads(body)["daemon"] == "degraded" and "truncated" in body, body
        status, answer = worker.post("/v1/completions", json.dumps(  # its experts: some lie past the end now
            {"model": "fixture", "prompt": "hello", "max_tokens": 16, "ignore_eos": True}).encode())
        error = answer["error"]
        assert status == 500 and error["code"] == "expert_unreadable", answer  # not daemon_unavailable: no retry helps
        assert "could not be read" in error["message"] and "expertpack verify" in error["message"], error

        other = fixture_packs["mixtral-a.Q4_K_M"][1]
        assert later.pop().stop()[0] == 0
        later.append(start_daemon(other, tmp_path / "c", "--endpoint", first.endpoint))
        later[-1].wait_for("READY=1")
        status, body = worker.get("/health")
        mine, theirs = Manifest.load(pack).fingerprint, Manifest.load(other).fingerprint
        assert status == 503 and json.loads(body)["daemon"] == "wrong_pack", body
        assert mine[:16] in body and theirs[:16] in body, body
        status, answer = worker.post("/v1/completions", json.dumps(
            {"model": "fixture", "prompt": "hello", "max_tokens": 2}).encode())
        assert status == 503 and answer["error"]["code"] == "daemon_wrong_pack", answer
    finally:
        assert worker.stop() == 0, worker.log
        first.notify.close()
        for d in later:
            d.stop()


def raw_http(worker: Worker, head: str, chunks=(), timeout: float = 10) -> tuple[int, dict]:
    """Sends a request head and then body chunks until the server answers; returns its status and
    JSON body. The server may answer before the body is sent (that is the point)."""
    import select

    with socket.create_connection(("127.0.0.1", worker.port), timeout=timeout) as s:
        s.sendall(head.encode())
        for chunk in chunks:
            if select.select([s], [], [], 0)[0]:
                break  # answered already
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while more := s.recv(65536):
            data += more
            head_bytes, sep, body = data.partition(b"\r\n\r\n")
            length = head_bytes.lower().partition(b"content-length:")[2].split(b"\r\n")[0]
            if sep and length and len(body) >= int(length):
                break
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(body)


def test_an_oversized_body_gets_413_before_it_is_read(served) -> None:
    _, _, worker = served
    start = time.monotonic()
    status, body = raw_http(worker, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                    "\r\nContent-Length: 45000000\r\n\r\n")  # 45 MB announced, none sent
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert time.monotonic() - start < 5
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"  # chunked: no length known in advance
    status, body = raw_http(worker, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 1000)
    assert status == 413 and "request body exceeds" in body["error"]["message"], body
    assert worker.get("/health")[0] == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(served) -> None:
    _, _, worker = served
    n_chars = served_context(worker) * 32 + 1
    client = worker.client()
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError, match=f"the prompt has {n_chars:,} characters") as err:
        client.completions.create(model="fixture", prompt="a" * n_chars, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="characters") as err:
        client.chat.completions.create(model="fixture", messages=[{"role": "user", "content": "b" * n_chars}])
    assert err.value.body["param"] == "messages"
    assert time.monotonic() - start < 5


def padded_completion(size_bytes: int) -> bytes:
    """A valid completions request of exactly size_bytes: JSON whitespace pads it."""
    body = b'{"model": "fixture", "prompt": "hi", "max_tokens": 1}'
    return body[:1] + b" " * (size_bytes - len(body)) + body[1:]


def test_configured_body_and_prompt_limits_hold_at_their_edges(served, tmp_path: Path) -> None:
    """--max-body-mib 1: a body of 1 MiB is served, one byte more gets 413 (announced, and chunked
    with no length given); --max-prompt-chars 100: 100 characters are served, 101 get 400 naming
    the limit and the flag, on both endpoints."""
    _, daemon, _ = served
    worker = start_worker(served[0], daemon.endpoint, tmp_path, "--max-body-mib", "1", "--max-prompt-chars", "100")
    try:
        limit = 1 << 20
        assert worker.post("/v1/completions", padded_completion(limit))[0] == 200
        status, body = raw_http(worker, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                        f"\r\nContent-Length: {limit + 1}\r\n\r\n")
        assert status == 413 and f"exceeds {limit:,} bytes" in body["error"]["message"], body
        over = padded_completion(limit + 1)
        chunks = [b"%x\r\n%b\r\n" % (len(over[i:i + 0x10000]), over[i:i + 0x10000]) for i in range(0, len(over), 0x10000)]
        status, body = raw_http(worker, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        "Transfer-Encoding: chunked\r\n\r\n", [*chunks, b"0\r\n\r\n"])
        assert status == 413 and body["error"]["code"] == "request_too_large", body

        client = worker.client()
        assert client.completions.create(model="fixture", prompt="a" * 100, max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.BadRequestError, match="the prompt has 101 characters; this worker takes at most "
                                                         "100 \\(--max-prompt-chars") as err:
            client.completions.create(model="fixture", prompt="a" * 101, max_tokens=1)
        assert err.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError, match="at most 100") as err:
            client.chat.completions.create(model="fixture", messages=[{"role": "user", "content": "b" * 101}])
        assert err.value.body["param"] == "messages"
        assert worker.get("/health")[0] == 200
    finally:
        assert worker.stop() == 0, worker.log


TOKENIZE_S = 3.0


def test_health_answers_while_a_prompt_is_being_tokenized(local, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing runs off the event loop: with a tokenizer made to take TOKENIZE_S per prompt (a
    very long prompt's cost), /health answers at once while a completion waits for its tokens. The
    app runs in this process under uvicorn, on the in-process engine (no daemon)."""
    import uvicorn

    from expertpack.worker.serve.api import WorkerService, create_app
    from expertpack.worker.serve.generation import Generator

    engine, tokenizer = local
    encode, tokenizing = tokenizer.encode, threading.Event()

    def slow_encode(text: str, add_special: bool = True) -> list[int]:
        tokenizing.set()
        time.sleep(TOKENIZE_S)
        return encode(text, add_special)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    service = WorkerService(Generator(engine, tokenizer), "fixture")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    worker = Worker(None, port, Path("/dev/null"))  # only its HTTP helpers
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert serving.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        answer: list[tuple[int, dict]] = []
        body = json.dumps({"model": "fixture", "prompt": "The quick brown fox", "max_tokens": 1}).encode()
        asking = threading.Thread(target=lambda: answer.append(worker.post("/v1/completions", body)))
        start = time.monotonic()
        asking.start()
        assert tokenizing.wait(10), "the completion never reached the tokenizer"
        asked = time.monotonic()
        assert worker.get("/health")[0] == 200
        health_s = time.monotonic() - asked
        asking.join(60)
        assert answer and answer[0][0] == 200, answer
        assert time.monotonic() - start >= TOKENIZE_S  # the tokenizing was in flight throughout
        assert health_s < TOKENIZE_S / 3, f"/health took {health_s:.2f} s behind a {TOKENIZE_S} s tokenization"
    finally:
        server.should_exit = True
        serving.join(30)
        service.shutdown()


def test_a_corrupt_pack_answers_500_expert_corrupt_streamed_or_not(fixture_packs, tmp_path: Path) -> None:
    """Every block of layer 0 damaged on disk: the request fails with 500 and code expert_corrupt (the
    pack's fault, not the daemon's absence: no retry helps), naming the expert; the worker stays up."""
    pack = tmp_path / "pack"
    shutil.copytree(fixture_packs[PACK][1], pack)
    layer = damage_layer(pack, 0)
    daemon = start_daemon(pack, tmp_path, "--client-slots", "4")
    daemon.wait_for("READY=1")
    worker = start_worker(pack, daemon.endpoint, tmp_path, ready="/v1/models")  # /health: degraded
    try:
        assert "ERROR warm-up: expert (layer 0" in worker.log and worker.get("/health")[0] == 503
        status, body = worker.post("/v1/completions", json.dumps(
            {"model": "fixture", "prompt": "hello", "max_tokens": 2}).encode())
        assert status == 500 and body["error"]["code"] == "expert_corrupt", body
        assert f"(layer {layer}, expert " in body["error"]["message"]
        req = urllib.request.Request(worker.url + "/v1/completions", json.dumps(
            {"model": "fixture", "prompt": "hello", "max_tokens": 2, "stream": True}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [line for line in r.read().decode().splitlines() if line.startswith("data: {")]
        assert json.loads(events[-1][6:])["error"]["code"] == "expert_corrupt"
        assert worker.get("/v1/models")[0] == 200
    finally:
        assert worker.stop() == 0, worker.log
        daemon.stop()
