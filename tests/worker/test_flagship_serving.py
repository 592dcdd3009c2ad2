"""The two flagship architectures served as users run them: a real expertd on the pack of each tiny
fixture (DeepSeek-V4-Flash's and Kimi-K3's, made by llama.cpp's converter from random models of the
real architectures) and a real expert-worker, spoken to with the official `openai` client. The chat
is rendered with each GGUF's own template (DeepSeek's <｜User｜> turns, Kimi-K3's <|open|> tags), and
the greedy answer, streamed and not, is the in-process engine's on the same rendered prompt."""

from __future__ import annotations

import pytest
import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.serve.chat_template import ChatTemplate
from expertpack.worker.serve.tokenizer import load_tokenizer

from ..conftest import start_daemon
from ..helpers.worker import start_worker

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
FLAGSHIPS = {  # pack -> how its own template opens a conversation
    "dsv4-tiny.Q2_K": "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Name a colour.<｜Assistant｜>",
    "k3-tiny.Q2_K": "<|open|>message role=\"system\"",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
def test_flagship_chat_through_expertd_equals_the_engine(name: str, fixture_packs, tmp_path) -> None:
    pack = fixture_packs[name][1]
    engine = Engine.load(pack)
    tokenizer = load_tokenizer(engine.files.metadata)
    prompt = ChatTemplate(engine.files.metadata).render(CHAT)
    assert prompt.startswith(FLAGSHIPS[name])  # the GGUF's own conversation format, not a generic one
    ids = tokenizer.encode(prompt, add_special=False)  # the template writes the BOS itself where the model has one
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id, *ids]
    tokens, _ = engine.generate(ids, 6, Sampler(), stop=set(tokenizer.stop_ids))
    want = tokenizer.decode(tokens)
    # each answer token's log-probability, from one pass over the prompt and the answer: a tiny random
    # model's few greedy tokens can survive a wrong prompt, these numbers cannot
    logits = engine.forward(ids + tokens[:-1], engine.new_sequence())[len(ids) - 1:]
    want_logprobs = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(tokens)), tokens].tolist()
    engine.close()

    daemon = start_daemon(pack, tmp_path, "--client-slots", "4")
    daemon.wait_for("READY=1")
    worker = start_worker(pack, daemon.endpoint, tmp_path)
    try:
        client = worker.client()
        got = client.chat.completions.create(model="fixture", messages=CHAT, max_tokens=6, temperature=0,
                                             logprobs=True)
        assert got.choices[0].message.content == want
        got_logprobs = [entry.logprob for entry in got.choices[0].logprobs.content]
        assert got_logprobs == pytest.approx(want_logprobs[:len(got_logprobs)], abs=1e-4) and got_logprobs
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(tokens)
        stream = client.chat.completions.create(model="fixture", messages=CHAT, max_tokens=6, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    finally:
        assert worker.stop() == 0, worker.log
        assert daemon.stop()[0] == 0
    assert "Traceback" not in worker.log
