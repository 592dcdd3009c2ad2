"""The incremental text stream hands out exactly what the whole-text one it replaced did (kept here
as ReferenceStream): the same pieces at the same tokens, the same stop, the same final text and the
same decoded lengths for logprobs' text_offset, over random id sequences of the fixtures' byte-level
(qwen3moe-a) and SentencePiece byte-fallback (mixtral-a) vocabularies, with multi-byte characters
split across tokens and stop strings that span several tokens."""

from __future__ import annotations

import random
from typing import Callable

import pytest

from expertpack.packtools.gguf_source import open_source
from expertpack.worker.serve.generation import _TextStream
from expertpack.worker.serve.tokenizer import GGUFTokenizer, TokenTexts, load_tokenizer

from ..conftest import FIXTURES

GGUFS = {"qwen3moe-a": "qwen3moe-a.Q2_K.gguf", "mixtral-a": "mixtral-a.Q2_K.gguf"}
TEXT = "It was the best of times, naïve café — 中文字符 😀🚀 ünïcödé ok\nend. "


class ReferenceStream:
    """The text stream before it was incremental: the whole id list decoded at each token and every
    stop string searched in all of it."""

    def __init__(self, tokenizer: GGUFTokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.sent = 0
        self.final: str | None = None
        self._decoded: tuple[int, str] = (0, "")

    def decoded(self, ids: list[int]) -> str:
        if self._decoded[0] != len(ids):
            self._decoded = (len(ids), self.tokenizer.decode(ids))
        return self._decoded[1]

    def add(self, ids: list[int]) -> bool:
        if not self.stop and self.on_text is None:
            return False
        text = self.decoded(ids)
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:
            self.final = text[:min(hits)]
            self._emit(self.final)
            return True
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        head = text[:safe]
        hold = max((n for s in self.stop for n in range(1, min(len(s), safe + 1)) if head.endswith(s[:n])), default=0)
        self._emit(head[:safe - hold])
        return False

    def finish(self, ids: list[int]) -> str:
        if self.final is None:
            text = self.decoded(ids)
            self.final = text
            self._emit(text)
        return self.final

    def _emit(self, text: str) -> None:
        if len(text) > self.sent and self.on_text is not None:
            self.on_text(text[self.sent:])
        self.sent = max(self.sent, len(text))


@pytest.fixture(scope="module", params=sorted(GGUFS))
def tokenizer(request) -> GGUFTokenizer:
    source = open_source(FIXTURES / "gguf" / request.param / GGUFS[request.param])
    return load_tokenizer({k: f.value for k, f in source.metadata.items()})


def pieces_of(tokenizer: GGUFTokenizer) -> tuple[list[list[int]], list[int]]:
    """Runs of ids that are whole characters (a multi-byte character as its single-byte tokens where
    the vocabulary has them) and ids to draw at random."""
    texts = TokenTexts(tokenizer)
    n = tokenizer.vocab_size
    single = {texts.bytes_of(i): i for i in range(n) if len(texts.bytes_of(i)) == 1 and i not in texts.added}
    runs = [[single[bytes([b])] for b in ch.encode()] for ch in "ïé—中文😀🚀ü" if all(bytes([b]) in single for b in ch.encode())]
    runs += [tokenizer.encode(w, add_special=False) for w in TEXT.split(" ")]
    # Byte-level BPE decodes the bytes of all tokens together, so any id may come; SentencePiece's
    # byte fallback turns a run of byte tokens holding an invalid sequence into one "\ufffd" per
    # token, which changes text before it (the old stream then took back nothing and emitted a
    # different text than its final): there only ids that are not single bytes are drawn.
    byte_level = texts.byte_level
    loose = [i for i in range(n) if byte_level or len(texts.bytes_of(i)) != 1 or i in texts.added]
    assert len(runs) > 8 and len(single) >= 200
    return runs, loose


def random_ids(rng: random.Random, runs: list[list[int]], loose: list[int], n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += rng.choice(runs) if rng.random() < 0.7 else [rng.choice(loose)]
    return ids


def run_stream(cls, tokenizer: GGUFTokenizer, ids: list[int], stop: tuple[str, ...], streamed: bool,
               offsets: bool) -> tuple[list[tuple[int, str]], int | None, str, list[int]]:
    """Feeds `ids` one at a time as generation does: (token index, piece) handed out, the index at
    which a stop string ended it, the final text and logprobs' text offsets."""
    pieces: list[tuple[int, str]] = []
    at: list[int] = [0]
    stream = cls(tokenizer, stop, (lambda p: pieces.append((at[0], p))) if streamed else None)
    so_far: list[int] = []
    text_offsets: list[int] = []
    stopped = None
    for i, token in enumerate(ids):
        at[0] = i
        so_far.append(token)
        if offsets:
            text_offsets.append(len(stream.decoded(so_far).rstrip("\ufffd")))
            if isinstance(stream, _TextStream):
                assert stream.complete_length(so_far) == text_offsets[-1]
        if stream.add(so_far):
            stopped = i
            break
    return pieces, stopped, stream.finish(so_far), text_offsets


@pytest.mark.parametrize("seed", range(12))
def test_pieces_stops_and_text_equal_the_whole_text_stream(tokenizer: GGUFTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    runs, loose = pieces_of(tokenizer)
    ids = random_ids(rng, runs, loose, 120)
    full = tokenizer.decode(ids)
    # Stop strings cut from the text itself, several tokens long, so that they span tokens; one
    # that never occurs; one holding a multi-byte character where there is one.
    clean = full.replace("\ufffd", "")
    stops: list[tuple[str, ...]] = [()]
    for _ in range(4):
        start = rng.randrange(max(1, len(clean) - 12))
        stops.append((clean[start:start + rng.randint(3, 12)], "zzzq never here", clean[-3:]))
    stops.append(("中文", "ü"))
    for stop in stops:
        for streamed in (True, False):
            offsets = rng.random() < 0.5
            want = run_stream(ReferenceStream, tokenizer, ids, stop, streamed, offsets)
            got = run_stream(_TextStream, tokenizer, ids, stop, streamed, offsets)
            assert got == want, f"stop={stop!r} streamed={streamed} offsets={offsets}"


def test_a_character_split_over_byte_tokens_waits_and_a_stop_across_tokens_cuts(tokenizer: GGUFTokenizer) -> None:
    runs, _ = pieces_of(tokenizer)
    split = next(r for r in runs if len(r) >= 3 and all(len(TokenTexts(tokenizer).bytes_of(i)) == 1 for i in r))
    ids = tokenizer.encode("say ", add_special=False) + split + tokenizer.encode(" best of times", add_special=False)
    for stop in ((), ("st of",), ("of t", "est")):
        want = run_stream(ReferenceStream, tokenizer, ids, stop, True, True)
        assert run_stream(_TextStream, tokenizer, ids, stop, True, True) == want
    pieces, stopped, text, _ = run_stream(_TextStream, tokenizer, ids, ("st of",), True, False)
    assert stopped is not None and text.endswith(" be") and "".join(p for _, p in pieces) == text
