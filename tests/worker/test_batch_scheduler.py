"""expert-worker's generation thread (serve/batching.py): requests generated together give each the
tokens it gets alone, whether it starts the batch, joins it mid-generation (its prompt run in
pieces between the others' steps) or waits for a slot; a cancelled request leaves the batch
clean; no more than --max-batch run at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.serve.batching import BatchScheduler
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
    assert gen.engine.arena.in_use == 0


def test_a_cancelled_request_leaves_the_batch_clean() -> None:
    gen = generator_for(MODELS["qwen3moe"])
    want = gen.run(request(gen, 2))
    scheduler = BatchScheduler(gen, max_batch=4)
    gone = threading.Event()
    try:
        left = scheduler.submit(request(gen, 3), lambda piece: gone.set(), cancelled=gone.is_set)
        stays = scheduler.submit(request(gen, 2))
        cut, done = left.result(timeout=300), stays.result(timeout=300)
    finally:
        scheduler.shutdown()
    assert 1 <= len(cut.token_ids) < LENGTHS[3]  # stopped at the token after its client left
    assert done.token_ids == want.token_ids
    assert gen.engine.arena.in_use == 0
    with pytest.raises(RuntimeError, match="stopped"):
        scheduler.submit(request(gen, 0))


def test_a_model_without_batched_steps_runs_one_at_a_time(tmp_path: Path) -> None:
    gen = generator_for("gguf/deepseek3-a/deepseek3-a.Q4_K_M.gguf")
    assert not getattr(gen.engine.model, "batched_decode", False)
    want = [gen.run(Request(gen.tokenizer.encode(p), 4, Sampler(), ignore_eos=True)) for p in PROMPTS[:2]]
    scheduler = BatchScheduler(gen, max_batch=4)
    assert scheduler.max_batch == 1
    try:
        futures = [scheduler.submit(Request(gen.tokenizer.encode(p), 4, Sampler(), ignore_eos=True))
                   for p in PROMPTS[:2]]
        assert [f.result(timeout=300).token_ids for f in futures] == [w.token_ids for w in want]
    finally:
        scheduler.shutdown()
