"""expert-worker's generation thread (serve/batching.py): requests generated together give each the
tokens it gets alone, whether it starts the batch, joins it mid-generation (its prompt run in
pieces between the others' steps, beside other prompts' pieces) or waits for a slot; a cancelled request
leaves the batch clean; no more than --max-batch run at once."""

from __future__ import annotations

import threading

import pytest

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.serve.batching import BatchScheduler, SchedulerStopped
from expertpack.worker.serve.generation import Generator, Request
from expertpack.worker.serve.tokenizer import load_tokenizer

from ..conftest import FIXTURES

MODELS = {"qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf", "gpt-oss": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf"}
PROMPTS = ["It was the best of times", "Call me Ishmael. Some years ago, never mind how long precisely",
           "In the beginning", "The quick brown fox jumps over the lazy dog and runs"]
LENGTHS = [9, 5, 12, 7]  # different lengths: requests leave while others run, the queued one joins


def generator_for(path: str) -> Generator:
    engine = Engine.load(FIXTURES / path)
    return Generator(engine, load_tokenizer(engine.files.metadata))


def request(gen: Generator, i: int) -> Request:
    return Request(gen.tokenizer.encode(PROMPTS[i]), LENGTHS[i], Sampler(), ignore_eos=True)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_batched_requests_get_their_tokens_alone(model: str) -> None:
    gen = generator_for(MODELS[model])
    want = [gen.run(request(gen, i)) for i in range(len(PROMPTS))]
    scheduler = BatchScheduler(gen, max_batch=3, prefill_chunk=4)  # prompts of 4+ tokens join in pieces
    seen = []  # sequences open whenever a piece of text is handed out (on the generation thread)
    pieces: list[list[str]] = [[] for _ in PROMPTS]

    def on_text(i: int, piece: str) -> None:
        pieces[i].append(piece)
        seen.append(gen.engine.arena.in_use)

    try:
        first = scheduler.submit(request(gen, 0), lambda p: on_text(0, p))
        futures = [first] + [scheduler.submit(request(gen, i), lambda p, i=i: on_text(i, p)) for i in (1, 2, 3)]
        got = [f.result(timeout=300) for f in futures]
    finally:
        scheduler.shutdown()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {i}: batched {g.token_ids} != alone {w.token_ids}"
        assert g.text == w.text == "".join(pieces[i]) and g.finish_reason == "length"
    assert max(seen) == 3 and 2 in seen  # three together; fewer once one left
    assert scheduler.times.prompt_pieces > scheduler.times.prompt_passes  # two prompts' pieces in one pass
    assert gen.engine.arena.in_use == 0


def test_a_cancelled_request_leaves_the_batch_clean() -> None:
    """A request whose client leaves while it decodes beside another stops at its next token; the
    other keeps its tokens, and every sequence is given back."""
    gen = generator_for(MODELS["qwen3moe"])
    want = gen.run(request(gen, 2))
    scheduler = BatchScheduler(gen, max_batch=4)
    gone = threading.Event()
    pieces: list[str] = []

    def third_piece_leaves(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            gone.set()

    try:
        stays = scheduler.submit(request(gen, 2))
        left = scheduler.submit(request(gen, 3), third_piece_leaves, cancelled=gone.is_set)
        cut, done = left.result(timeout=300), stays.result(timeout=300)
    finally:
        scheduler.shutdown()
    assert 3 <= len(cut.token_ids) < LENGTHS[3] and cut.finish_reason == "length"  # a piece may span tokens
    assert done.token_ids == want.token_ids
    assert gen.engine.arena.in_use == 0
    with pytest.raises(SchedulerStopped, match="stopped"):
        scheduler.submit(request(gen, 0))


def test_a_failing_request_fails_alone_and_shutdown_answers_the_queued() -> None:
    """A request whose text sink raises fails with that error, the one beside it is answered; at
    shutdown a request still queued gets an error instead of waiting forever."""
    gen = generator_for(MODELS["qwen3moe"])
    want = gen.run(request(gen, 2))

    def broken(piece: str) -> None:
        raise OSError("the client's socket is gone")

    holding, hold = threading.Event(), threading.Event()

    def hold_the_thread(piece: str) -> None:
        holding.set()
        hold.wait(30)

    scheduler = BatchScheduler(gen, max_batch=2)
    try:
        ok = scheduler.submit(request(gen, 2))
        bad = scheduler.submit(request(gen, 0), broken)
        with pytest.raises(OSError, match="socket is gone"):
            bad.result(timeout=300)
        assert ok.result(timeout=300).token_ids == want.token_ids
        blocker = scheduler.submit(request(gen, 1), hold_the_thread)
        assert holding.wait(60)  # the blocker runs: what is submitted now waits in the queue
        queued = [scheduler.submit(request(gen, i)) for i in (0, 1, 2)]
    finally:
        stopper = threading.Thread(target=scheduler.shutdown)
        stopper.start()
        hold.set()
        stopper.join(timeout=300)
    assert blocker.result(timeout=1).finish_reason == "length"  # stopped at its next token
    outcomes = [f.exception(timeout=1) for f in queued]
    assert any(isinstance(e, SchedulerStopped) for e in outcomes)
    assert gen.engine.arena.in_use == 0


def test_a_model_without_batched_steps_runs_one_at_a_time() -> None:
    gen = generator_for("gguf/deepseek3-a/deepseek3-a.Q4_K_M.gguf")
    assert not getattr(gen.engine.model, "batched_decode", False)
    want = [gen.run(Request(gen.tokenizer.encode(p), 4, Sampler(), ignore_eos=True)) for p in PROMPTS[:2]]
    scheduler = BatchScheduler(gen, max_batch=4)
    assert scheduler.max_batch == 1
    open_at_text: list[int] = []
    try:
        futures = [scheduler.submit(Request(gen.tokenizer.encode(p), 4, Sampler(), ignore_eos=True),
                                    lambda piece: open_at_text.append(gen.engine.arena.in_use)) for p in PROMPTS[:2]]
        assert [f.result(timeout=300).token_ids for f in futures] == [w.token_ids for w in want]
    finally:
        scheduler.shutdown()
    assert open_at_text and max(open_at_text) == 1


def test_stop_strings_logprobs_and_sampling_in_a_batch_are_what_they_are_alone() -> None:
    """A step's text is handed out once the next step is launched (off the GPU's path): a request
    that a stop string ends then has one step more run for it, which is dropped. Its text, tokens
    and finish reason, and the others' (logprobs, a seeded sampler with penalties, greedy), are
    what each gets alone; the text streamed is the text answered."""
    gen = generator_for(MODELS["qwen3moe"])
    ids = [gen.tokenizer.encode(p) for p in PROMPTS]
    plain = gen.run(Request(ids[0], 12, Sampler(), ignore_eos=True))
    middle = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    assert middle.strip(), plain.text
    reqs = [Request(ids[0], 12, Sampler(), stop=(middle,), ignore_eos=True),
            Request(ids[1], 6, Sampler(), ignore_eos=True, logprobs=3),
            Request(ids[2], 8, Sampler(temperature=0.8, top_k=20, seed=7, frequency_penalty=0.5), ignore_eos=True),
            Request(ids[3], 10, Sampler(), ignore_eos=True)]
    want = [gen.run(Request(r.prompt_ids, r.max_tokens, Sampler(**{k: getattr(r.sampler, k) for k in (
        "temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty")}), r.stop, r.ignore_eos,
        r.logprobs)) for r in reqs]
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) < 12
    pieces: list[list[str]] = [[] for _ in reqs]
    scheduler = BatchScheduler(gen, max_batch=4)
    try:
        futures = [scheduler.submit(r, pieces[i].append) for i, r in enumerate(reqs)]
        got = [f.result(timeout=300) for f in futures]
    finally:
        scheduler.shutdown()
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason), f"request {i}"
        assert "".join(pieces[i]) == g.text, f"request {i}: streamed text"
    assert [e.token for e in got[1].logprobs] == [e.token for e in want[1].logprobs]
    assert [e.text_offset for e in got[1].logprobs] == [e.text_offset for e in want[1].logprobs]
    for g, w in zip(got[1].logprobs, want[1].logprobs):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4) and [t for t, _ in g.top] == [t for t, _ in w.top]
    assert gen.engine.arena.in_use == 0


def test_a_step_failing_on_the_device_ends_its_requests_not_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's error can surface when the host waits for it (an asynchronous CUDA error): the
    requests in that step fail with it, and the next request is served."""
    from expertpack.worker.serve import batching

    gen = generator_for(MODELS["qwen3moe"])
    want = gen.run(request(gen, 2))
    failures = []

    def fails_once(device) -> None:
        if not failures:
            failures.append(device)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(batching, "sync_device", fails_once)
    scheduler = BatchScheduler(gen, max_batch=2)
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            scheduler.submit(request(gen, 0)).result(timeout=300)
        assert scheduler.submit(request(gen, 2)).result(timeout=300).token_ids == want.token_ids
    finally:
        scheduler.shutdown()
    assert gen.engine.arena.in_use == 0
