"""The OpenAI-compatible API says no instead of ignoring: a real expertd and expert-worker, spoken to
with the official `openai` client and with raw HTTP.

- logprobs (chat: `logprobs`/`top_logprobs`; completions: `logprobs` k) are the log-softmax of the
  model's logits at each step, bit for bit what an in-process forward gives, streamed or not;
- `n` choices, `presence_penalty`/`frequency_penalty` (OpenAI's formula, checked against a naive
  loop) and `logit_bias` change what is generated, never the logprobs (the model's distribution);
- every field that is not implemented, and every unknown one, is refused with 400 naming it; a value
  that asks for nothing (`"tools": []`, null) is accepted;
- a non-streamed client that leaves is logged once as such, and its generation stops.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest
import torch

from expertpack.worker.serve.chat_template import ChatTemplate

from ..helpers.worker import CHAT, Worker, open_stream, served_context


@pytest.fixture(scope="module")
def worker(served) -> Worker:
    return served[2]


def chat_ids(local) -> list[int]:
    engine, tokenizer = local
    return tokenizer.encode(ChatTemplate(engine.files.metadata).render(CHAT))


def oracle(local, prompt_ids: list[int], n: int, choose=None) -> list[tuple[int, torch.Tensor]]:
    """(token, log-softmax of the logits it was chosen from) for n steps of one in-process forward;
    `choose(logits, tokens so far)` picks (default: greedy, the lower id on ties)."""
    engine, _ = local
    choose = choose or (lambda logits, _: int(torch.argmax(logits)))
    kv = engine.new_sequence()
    logits = engine.forward(prompt_ids, kv, last=True)[-1]  # as a generation: the head on the last row
    steps: list[tuple[int, torch.Tensor]] = []
    for _ in range(n):
        token = choose(logits, [t for t, _ in steps])
        steps.append((token, torch.log_softmax(logits.to(torch.float32), dim=-1)))
        logits = engine.forward([token], kv)[-1]
    return steps


def how_served(worker: Worker) -> str:
    """For an exact comparison that failed (seen once in a full parallel run, never alone): the steps
    the server ran by rows (a row decoded beside another may round otherwise on the CPU, where a
    batched step is one matrix product), its generation thread's time and its last log lines."""
    metrics = [line for line in worker.get("/metrics")[1].splitlines()
               if line.startswith(("expertpack_decode_steps", "expertpack_prompt_p", "expertpack_generation_thread"))]
    return "server: " + "; ".join(metrics) + "\n" + "\n".join(worker.log.splitlines()[-12:])


def top(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    order = sorted(range(logp.numel()), key=lambda i: (-float(logp[i]), i))[:k]
    return [(i, float(logp[i])) for i in order]


def token_bytes(local, token: int) -> bytes:
    """The fixture's tokenizer is byte-level BPE: a vocabulary entry spells its bytes one character each."""
    _, tokenizer = local
    return bytes(_BYTE_OF_CHAR[c] for c in tokenizer.tok.id_to_token(token))


def token_text(local, token: int) -> str:
    """As OpenAI writes a token that is not whole UTF-8: `bytes:\\xNN...`."""
    raw = token_bytes(local, token)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _gpt2_bytes() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = _gpt2_bytes()  # transcribed from GPT-2's encoder.py (bytes_to_unicode)


def sse_events(worker: Worker, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(worker.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]


def test_chat_logprobs_are_the_models_log_softmax_streamed_or_not(worker: Worker, local) -> None:
    n_tokens, k = 12, 3
    steps = oracle(local, chat_ids(local), n_tokens)
    got = worker.client().chat.completions.create(model="fixture", messages=CHAT, max_tokens=n_tokens, temperature=0,
                                                  logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
    entries = got.choices[0].logprobs.content
    assert len(entries) == n_tokens
    for (token, logp), entry in zip(steps, entries):
        assert entry.logprob == float(logp[token]), how_served(worker)  # exact: the same logits and log-softmax
        assert bytes(entry.bytes) == token_bytes(local, token)
        assert [(bytes(t.bytes), t.logprob) for t in entry.top_logprobs] == \
               [(token_bytes(local, i), v) for i, v in top(logp, k)]
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert text == got.choices[0].message.content

    events = sse_events(worker, "/v1/chat/completions", {
        "model": "fixture", "messages": CHAT, "max_tokens": n_tokens, "temperature": 0, "logprobs": True,
        "top_logprobs": k, "ignore_eos": True, "stream": True})
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == [e.model_dump() for e in entries]
    streamed_text = "".join(c["delta"].get("content") or "" for ev in events for c in ev["choices"])
    assert streamed_text == got.choices[0].message.content


def test_completions_logprobs_give_the_legacy_lists(worker: Worker, local) -> None:
    _, tokenizer = local
    prompt, n_tokens, k = "The quick brown fox", 10, 2
    steps = oracle(local, tokenizer.encode(prompt), n_tokens)
    got = worker.client().completions.create(model="fixture", prompt=prompt, max_tokens=n_tokens, temperature=0,
                                             logprobs=k, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == [float(logp[t]) for t, logp in steps], how_served(worker)
    assert lp.tokens == [token_text(local, t) for t, _ in steps]
    for (token, logp), best in zip(steps, lp.top_logprobs):
        want: dict[str, float] = {}
        for i, v in top(logp, k):
            want.setdefault(token_text(local, i), v)
        assert best == want
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(got.choices[0].text)
    events = sse_events(worker, "/v1/completions", {"model": "fixture", "prompt": prompt, "max_tokens": n_tokens,
                                                    "temperature": 0, "logprobs": k, "ignore_eos": True,
                                                    "stream": True})
    streamed = [v for ev in events for c in ev["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == lp.token_logprobs


def test_n_choices_one_after_another(worker: Worker) -> None:
    client = worker.client()
    one = client.completions.create(model="fixture", prompt="Once", max_tokens=8, temperature=1.0, seed=5,
                                    extra_body={"ignore_eos": True})
    three = client.completions.create(model="fixture", prompt="Once", max_tokens=8, temperature=1.0, seed=5, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # one sampler throughout: choice 0 is what n=1 gives
    assert len({c.text for c in three.choices}) > 1, "three sampled choices came out identical"
    assert three.usage.completion_tokens == 24 and three.usage.prompt_tokens == one.usage.prompt_tokens

    chat = client.chat.completions.create(model="fixture", messages=CHAT, max_tokens=6, temperature=0, n=2)
    events = sse_events(worker, "/v1/chat/completions", {"model": "fixture", "messages": CHAT, "max_tokens": 6,
                                                         "temperature": 0, "n": 2, "stream": True})
    for i in range(2):
        text = "".join(c["delta"].get("content") or "" for ev in events for c in ev["choices"] if c["index"] == i)
        assert text == chat.choices[i].message.content == chat.choices[0].message.content
        assert [c["finish_reason"] for ev in events for c in ev["choices"] if c["index"] == i and c["finish_reason"]] \
            == [chat.choices[i].finish_reason]


def test_penalties_follow_openais_formula_and_logprobs_stay_the_models(worker: Worker, local) -> None:
    _, tokenizer = local
    prompt, n_tokens, presence, frequency = "one one one one", 16, 0.5, 1.5
    ids = tokenizer.encode(prompt)

    def penalized(logits: torch.Tensor, so_far: list[int]) -> int:
        adjusted = logits.to(torch.float32).clone()
        for t in set(so_far):
            adjusted[t] -= so_far.count(t) * frequency + presence
        return int(torch.argmax(adjusted))

    want = oracle(local, ids, n_tokens, penalized)
    plain = oracle(local, ids, n_tokens)
    assert [t for t, _ in want] != [t for t, _ in plain], "the penalties change nothing on this prompt"
    got = worker.client().completions.create(model="fixture", prompt=prompt, max_tokens=n_tokens, temperature=0,
                                             presence_penalty=presence, frequency_penalty=frequency, logprobs=0,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].text == tokenizer.decode([t for t, _ in want])
    unpenalized = [float(logp[t]) for t, logp in want]
    assert got.choices[0].logprobs.token_logprobs == unpenalized, how_served(worker)

    biased = worker.client().completions.create(model="fixture", prompt=prompt, max_tokens=4, temperature=0,
                                                logit_bias={"42": 100}, logprobs=0, extra_body={"ignore_eos": True})
    forced = oracle(local, ids, 4, lambda logits, _: 42)
    assert biased.choices[0].text == tokenizer.decode([42] * 4)
    assert biased.choices[0].logprobs.token_logprobs == [float(logp[42]) for _, logp in forced]


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "min_p", 0.1),  # unknown to OpenAI: refused as OpenAI refuses it
    ("/v1/chat/completions", "top_logprobs", 2),  # without logprobs: true
    ("/v1/chat/completions", "presence_penalty", 2.5),
    ("/v1/chat/completions", "n", 0),
    ("/v1/chat/completions", "stream_options", {"include_usage": True, "include_obfuscation": False}),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "frequency_penalty", -3),
    ("/v1/completions", "logit_bias", {"not-a-token": 5}),
    ("/v1/completions", "logit_bias", {"5": 101}),
    ("/v1/completions", "logit_bias", {"\u00b2": 5}),  # a digit to str.isdigit, not to int()
    ("/v1/completions", "logit_bias", {"1" * 5000: 5}),  # more digits than int() reads
    ("/v1/completions", "seed", 2**64),
    ("/v1/completions", "messages", CHAT),
])
def test_what_is_not_implemented_is_refused_naming_the_field(worker: Worker, path: str, field: str, value) -> None:
    base = {"model": "fixture", "max_tokens": 2}
    base.update({"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"})
    status, body = worker.post(path, json.dumps({**base, field: value}).encode())
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"].split(".")[0] == field, body
    assert field in body["error"]["message"], body


def test_values_that_ask_for_nothing_and_annotations_are_accepted(worker: Worker) -> None:
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "store": False,
               "modalities": ["text"], "user": "someone", "metadata": {"k": "v"}, "parallel_tool_calls": True,
               "temperature": None, "n": None, "stop": None, "seed": None, "logit_bias": {}}
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "messages": CHAT, "max_tokens": 2, **neutral}).encode())
    assert status == 200, body
    status, body = worker.post("/v1/completions", json.dumps(
        {"model": "fixture", "prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": "", "echo": False}).encode())
    assert status == 200, body


def test_message_fields_the_template_never_sees_are_refused(worker: Worker) -> None:
    messages = [CHAT[0], {**CHAT[1], "name": "alice"}]
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "messages": messages, "max_tokens": 2}).encode())
    assert status == 400 and body["error"]["param"] == "messages[1].name", body
    echoed = [CHAT[0], {**CHAT[1], "tool_calls": None, "refusal": None}]  # a client echoing a message back: nulls
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "messages": echoed, "max_tokens": 2}).encode())
    assert status == 200, body


def test_a_vanishing_temperature_or_top_p_samples_greedily(worker: Worker) -> None:
    """temperature 1e-320 and top_p 5e-324 are what greedy chooses (they were 500: "probability
    tensor contains either inf, nan"): the limit of sampling as they go to 0 (generation.py)."""
    def text(**sampling) -> str:
        status, body = worker.post("/v1/completions", json.dumps({"model": "fixture", "prompt": "Once", "max_tokens": 6,
                                                                 "ignore_eos": True, **sampling}).encode())
        assert status == 200, (sampling, body)
        return body["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1e-320) == text(temperature=1, top_p=5e-324) == greedy


def test_what_no_json_reader_takes_gets_an_openai_error(worker: Worker) -> None:
    """A body Python's JSON reader refuses (a 5,000-digit number, arrays nested 100,000 deep) and
    an unknown path were FastAPI's {"detail": ...}; they are OpenAI's error shape like any other."""
    head = b'{"model": "fixture", "prompt": "hi", "max_tokens": 2, '
    for body, needle in ((head + b'"seed": ' + b"7" * 5000 + b"}", "more than 4,300 digits"),
                         (head + b'"user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply")):
        status, answer = worker.post("/v1/completions", body)
        assert status == 400 and set(answer) == {"error"}, answer
        assert answer["error"]["type"] == "invalid_request_error" and needle in answer["error"]["message"], answer
    status, text = worker.get("/v1/nowhere")
    assert status == 404 and json.loads(text)["error"]["type"] == "invalid_request_error", text


def test_a_chat_is_bounded_before_its_template_renders_it(worker: Worker) -> None:
    """55,000 empty messages (1.8 MB: within the body limit, no characters of content) rendered to
    275,005 tokens before the context refused them, each message validated on the event loop:
    refused now before any is, as more than OpenAI takes. Fewer messages whose rendering (the
    template's own text around each) passes --max-prompt-chars stop rendering there."""
    empty = {"role": "user", "content": ""}
    start = time.monotonic()
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "max_tokens": 1, "messages": [empty] * 55_000}).encode())
    assert status == 400 and body["error"]["param"] == "messages", body
    assert "55,000 messages; at most 2,048" in body["error"]["message"], body
    assert time.monotonic() - start < 1.0
    max_chars = served_context(worker) * 32
    content = "x" * (max_chars // 2048 - 1)  # their content fits the bound; with the template's text, not
    status, body = worker.post("/v1/chat/completions", json.dumps(
        {"model": "fixture", "max_tokens": 1, "messages": [{"role": "user", "content": content}] * 2048}).encode())
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert f"render to more than {max_chars:,} characters" in body["error"]["message"], body
    assert worker.client().chat.completions.create(model="fixture", messages=CHAT, max_tokens=1).choices


def test_a_non_streamed_client_that_leaves_is_logged_once_and_its_generation_stops(worker: Worker) -> None:
    body = json.dumps({"model": "fixture", "prompt": "leave me", "max_tokens": 3000, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(1.5)  # generating
    deadline = time.monotonic() + 60
    note = "the client disconnected before the answer"
    while note not in worker.log and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in worker.log.splitlines() if note in line]
    assert len(lines) == 1, worker.log
    assert "/v1/completions 499:" in lines[0] and "of the 3000 tokens asked for" in lines[0], lines[0]
    assert int(lines[0].split(" + ")[1].split()[0]) < 3000, f"the abandoned generation ran on: {lines[0]}"
    ok = worker.client().completions.create(model="fixture", prompt="next", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    time.sleep(0.5)
    assert len([line for line in worker.log.splitlines() if note in line]) == 1


def test_a_request_joins_one_generating_and_is_answered_before_it_ends(worker: Worker) -> None:
    """--max-batch by default (what fits, logged): a short request sent while a long streamed one
    generates is answered while the long one still streams (one at a time, it would wait for all 400
    tokens of the other), with the text it gets alone."""
    fits = re.search(r"--max-batch (\d+): what fits \(cpu: ", worker.log)
    assert fits and int(fits.group(1)) >= 2, worker.log
    long = json.dumps({"model": "fixture", "prompt": "hold the line", "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    short = json.dumps({"model": "fixture", "prompt": "a short one", "max_tokens": 3, "temperature": 0,
                        "ignore_eos": True}).encode()
    s, seen = open_stream(worker.port, long, timeout=60)
    with s:
        status, together = worker.post("/v1/completions", short)
        s.setblocking(False)  # what the long one sent until now, without waiting for more
        try:
            while piece := s.recv(65536):
                seen += piece
        except BlockingIOError:
            pass
        assert status == 200 and b"[DONE]" not in seen, "the short request waited for the long one"
    status, alone = worker.post("/v1/completions", short)
    assert status == 200 and together["choices"][0]["text"] == alone["choices"][0]["text"]
    assert together["usage"]["completion_tokens"] == 3
    steps = re.search(r'^expertpack_decode_steps_total\{rows="2"\} (\d+)', worker.get("/metrics")[1], re.M)
    assert steps and int(steps.group(1)) >= 2, "no step of the two together in /metrics"


def test_past_the_queue_a_request_gets_503_at_once_and_its_place_comes_back(served, tmp_path) -> None:
    """--max-batch 1 --max-queue 1: a streamed request generating and one waiting behind it take
    every place; a third gets 503 queue_full with Retry-After at once (the gauge in /metrics says 2
    meanwhile).
    The streaming client leaving gives its place back, the waiting one is then answered, and a
    new request is admitted again."""
    from concurrent.futures import ThreadPoolExecutor

    from ..helpers.worker import metric_values, start_worker

    pack, daemon, _ = served
    w = start_worker(pack, daemon.endpoint, tmp_path, "--max-batch", "1", "--max-queue", "1")
    try:
        body = json.dumps({"model": "fixture", "prompt": "hold the line", "max_tokens": 3000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        small = json.dumps({"model": "fixture", "prompt": "wait", "max_tokens": 2, "temperature": 0}).encode()
        s, _ = open_stream(w.port, body, timeout=30)
        with s:
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(w.post, "/v1/completions", small)
                deadline = time.monotonic() + 30
                while metric_values(w)["expertpack_requests_in_flight"] < 2:
                    assert time.monotonic() < deadline and not waiting.done(), "the second request was not queued"
                    time.sleep(0.05)
                req = urllib.request.Request(w.url + "/v1/completions", small, {"Content-Type": "application/json"})
                started = time.monotonic()
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(req, timeout=30)
                assert time.monotonic() - started < 5, "refused only after a wait"
                assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
                error = json.loads(refused.value.read())["error"]
                assert error["code"] == "queue_full" and "--max-queue 1" in error["message"], error
                s.close()  # the streaming client leaves: its generation stops, the waiting one runs
                status, answer = waiting.result(timeout=120)
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1
        deadline = time.monotonic() + 30
        while metric_values(w)["expertpack_requests_in_flight"] != 0:
            assert time.monotonic() < deadline, "a place was never given back"
            time.sleep(0.05)
        assert w.post("/v1/completions", small)[0] == 200
        assert 'expertpack_requests_total{endpoint="/v1/completions",code="503"} 1\n' in w.get("/metrics")[1]
    finally:
        assert w.stop() == 0, w.log
