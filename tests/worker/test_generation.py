"""One generation request in process (the part of expert-worker below HTTP): stop strings cut the
text before the earliest one, whichever the list names first; streamed pieces always add up to
the final text, with nothing taken back; a request whose client left before its turn never runs."""

from __future__ import annotations

import pytest

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.serve.generation import Generator, Request
from expertpack.worker.serve.tokenizer import load_tokenizer

from ..conftest import FIXTURES


@pytest.fixture(scope="module")
def generator() -> Generator:
    engine = Engine.load(FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q4_K_M.gguf")
    return Generator(engine, load_tokenizer(engine.files.metadata))


def run(generator: Generator, stop: tuple[str, ...] = (), n: int = 40):
    pieces: list[str] = []
    req = Request(generator.tokenizer.encode("It was the best of times"), n, Sampler(), stop, ignore_eos=True)
    done = generator.run(req, pieces.append)
    assert "".join(pieces) == done.text, "streamed pieces differ from the final text"
    return done


def test_stop_strings_cut_before_the_earliest(generator: Generator) -> None:
    full = run(generator)
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    text = full.text
    clean = [i for i in range(1, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip()]
    assert len(clean) >= 2, f"the fixture's greedy text has too little plain text: {text!r}"
    early, late = text[clean[0]:clean[0] + 3], text[clean[-1]:clean[-1] + 3]
    cut = run(generator, stop=(late, early))  # the later one listed first
    assert cut.finish_reason == "stop"
    assert cut.text == text[:min(text.find(early), text.find(late))]
    assert len(cut.token_ids) < 40


def test_a_request_whose_client_left_never_runs(generator: Generator) -> None:
    req = Request(generator.tokenizer.encode("hello"), 10, Sampler())
    done = generator.run(req, cancelled=lambda: True)
    assert done.finish_reason == "cancelled" and done.token_ids == [] and done.text == ""


def test_a_warm_up_leaves_no_trace_in_later_requests() -> None:
    """Generator.warm_up (what expert-worker runs before it says ready) runs prompts and steps in
    the engine's arena slots and sampled generations: the next request's tokens and text are
    those of an engine that never warmed up."""
    engine = Engine.load(FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q4_K_M.gguf")
    cold = Generator(engine, load_tokenizer(engine.files.metadata))
    want = run(cold, n=12)
    warm = Generator(Engine.load(FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q4_K_M.gguf"), cold.tokenizer)
    assert warm.warm_up(batch=3) == "prompts run eagerly"  # on the CPU nothing is captured; batched steps run
    assert warm.engine.arena.in_use == 0
    got = run(warm, n=12)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
