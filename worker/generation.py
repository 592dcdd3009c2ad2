"""One generation request from token ids to text: prefill, then one token at a time until a stop
token, a stop string or max_tokens, with text handed out as it becomes final (a streamed piece
never has to be taken back: an incomplete UTF-8 sequence or a possible start of a stop string is
held until it resolves). Measures what the request cost: prefill and decode rates, and from the
expert cache the unique-key hit rate and the expert bytes expertd read for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .engine import Engine
from .sampling import Sampler
from .tokenizer import GGUFTokenizer


class ContextExceeded(ValueError):
    """The prompt and the requested completion do not fit the model's context."""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache: dict[str, float] = field(default_factory=dict)  # the expert cache's counters for this request

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which the prefill produced) over the time they took."""
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0

    @property
    def hit_rate(self) -> float | None:
        looked = self.cache.get("hits", 0) + self.cache.get("misses", 0)
        return self.cache["hits"] / looked if looked else None

    @property
    def ssd_bytes(self) -> int:
        return int(self.cache.get("h2d_bytes", 0))


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or string), "length", or "cancelled" (nobody is waiting)
    usage: Usage


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: exactly max_tokens


class Generator:
    def __init__(self, engine: Engine, tokenizer: GGUFTokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        arch = engine.files.arch
        self.n_ctx = int(engine.files.metadata.get(f"{arch}.context_length", 4096))

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.n_ctx:
            raise ContextExceeded(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.")

    def run(self, req: Request, on_text: Callable[[str], None] | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> Completion:
        """Generates; `on_text` gets each final piece of text. `cancelled` is polled per token."""
        self.check_fits(len(req.prompt_ids), req.max_tokens)
        cache_counters = self.engine.expert_cache.counters if self.engine.expert_cache else None
        before = cache_counters.snapshot() if cache_counters else None
        usage = Usage(len(req.prompt_ids))
        text = _TextStream(self.tokenizer, req.stop, on_text)
        kv = self.engine.new_cache()
        stops = set() if req.ignore_eos else set(self.tokenizer.stop_ids)
        finish = "length"
        start = time.perf_counter()
        ids: list[int] = []
        if cancelled():  # the client left while this request waited its turn
            return Completion("", ids, "cancelled", usage)
        logits = self.engine.forward(req.prompt_ids, kv)[-1]
        while len(ids) < req.max_tokens and not cancelled():
            token = req.sampler(logits)
            if not ids:
                _sync(self.engine.device)
                usage.prefill_s = time.perf_counter() - start
                start = time.perf_counter()
            ids.append(token)
            if token in stops:
                finish = "stop"
                break
            if text.add(ids):
                finish = "stop"
                break
            if len(ids) < req.max_tokens:
                logits = self.engine.forward([token], kv)[-1]
        usage.decode_s = time.perf_counter() - start if ids else 0.0
        usage.completion_tokens = len(ids)
        if cache_counters:
            usage.cache = cache_counters.since(before)
        return Completion(text.finish(ids), ids, finish, usage)


class _TextStream:
    """Decodes the growing id list and hands out only text that cannot change any more."""

    def __init__(self, tokenizer: GGUFTokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.sent = 0  # characters handed out
        self.final: str | None = None

    def add(self, ids: list[int]) -> bool:
        """True when a stop string appeared (the text is then cut before it)."""
        if not self.stop and self.on_text is None:
            return False  # nobody reads text before the end: decode once, in finish()
        text = self.tokenizer.decode(ids)
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:  # the earliest stop string wins, whichever comes first in the list
            self.final = text[:min(hits)]
            self._emit(self.final)
            return True
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: the next token completes it
            safe = len(text.rstrip("\ufffd"))
        head = text[:safe]  # keep back a tail that may be the start of a stop string
        hold = max((n for s in self.stop for n in range(1, min(len(s), safe + 1)) if head.endswith(s[:n])), default=0)
        self._emit(head[:safe - hold])
        return False

    def finish(self, ids: list[int]) -> str:
        if self.final is None:
            text = self.tokenizer.decode(ids)
            self.final = text
            self._emit(text)
        return self.final

    def _emit(self, text: str) -> None:
        if len(text) > self.sent and self.on_text is not None:
            self.on_text(text[self.sent:])
        self.sent = max(self.sent, len(text))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
