"""One generation request from token ids to text: prefill, then one token at a time until a stop
token, a stop string or max_tokens, with text handed out as it becomes final (a streamed piece
never has to be taken back: an incomplete UTF-8 sequence or a possible start of a stop string is
held until it resolves). Measures what the request cost: prefill and decode rates, and from the
expert cache the unique-key hit rate and the expert bytes expertd read for it.

Log-probabilities, when asked for, are the model's distribution: the log-softmax (float32) of the
very logits the sampler is handed at that step, before penalties, logit_bias, temperature, top-k and
top-p (OpenAI's and vLLM's default meaning). Every generated token gets one except a final stop
token (end of sequence or turn), whose text is not in the answer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.arena import Sequence
from ..engine.engine import Engine
from ..engine.sampling import Sampler
from .tokenizer import GGUFTokenizer


# Below this temperature sampling is greedy, as in vLLM (its _SAMPLING_EPS); llama-server reads the
# temperature as a float32, in which 1e-300 is 0, greedy. Greedy is the limit of sampling as the
# temperature goes to 0, and the only way to compute it: logits divided by 1e-300 overflow float32,
# and the softmax of inf - inf is NaN.
GREEDY_TEMPERATURE = 1e-5


def sampling_temperature(temperature: float, top_p: float, n_vocab: int) -> float:
    """The temperature to sample at: 0 (greedy) when sampling can only choose the most likely
    token, either below GREEDY_TEMPERATURE or with a top_p below 1/n_vocab: the most likely
    token's probability is at least that, so the nucleus holds it alone (and a top_p of 5e-324
    is 0 in float32, which keeps nothing)."""
    return 0.0 if temperature < GREEDY_TEMPERATURE or top_p < 1 / n_vocab else temperature


class ContextExceeded(ValueError):
    """The prompt and the requested completion do not fit the model's context."""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache: dict[str, float] = field(default_factory=dict)  # the expert cache's counters for this request
    prefills: int = 1  # choices that each ran the prompt (n > 1: the prompt counts once, its work n times)

    @classmethod
    def combined(cls, usages: list["Usage"]) -> "Usage":
        """Several choices of one request: the prompt counted once (as OpenAI counts it), the rest summed."""
        cache: dict[str, float] = {}
        for u in usages:
            for k, v in u.cache.items():
                cache[k] = cache.get(k, 0) + v
        return cls(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                   sum(u.prefill_s for u in usages), sum(u.decode_s for u in usages), cache,
                   sum(u.prefills for u in usages))

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens * self.prefills / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first of each choice (which its prefill produced) over the time they took."""
        n = self.completion_tokens - self.prefills
        return n / self.decode_s if n > 0 and self.decode_s else 0.0

    @property
    def hit_rate(self) -> float | None:
        looked = self.cache.get("hits", 0) + self.cache.get("misses", 0)
        return self.cache["hits"] / looked if looked else None

    @property
    def fetched_bytes(self) -> int:
        """Expert bytes copied into the VRAM cache (from the RAM tier or the pack alike)."""
        return int(self.cache.get("h2d_bytes", 0))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model and the `top` most likely tokens at that
    step (most likely first; equal values: the lower id first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    text_offset: int  # characters of the choice's text before this token's


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or string), "length", or "cancelled" (nobody is waiting)
    usage: Usage
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: exactly max_tokens
    logprobs: int | None = None  # None: none; k >= 0: each token's and the k most likely at each step


class Generator:
    def __init__(self, engine: Engine, tokenizer: GGUFTokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        arch = engine.files.arch
        self.n_ctx = int(engine.files.metadata.get(f"{arch}.context_length", 4096))

    def warm_up(self, batch: int = 1) -> str:
        """Engine.warm_up (`batch`: the requests that may decode together), then two short
        generations (greedy and sampled, with penalties) through this generator, so that the
        first requests compile and capture nothing. -> what it did."""
        token = self.tokenizer.bos_id or 0
        captured = self.engine.warm_up(token, batch=batch)
        for sampler in (Sampler(), Sampler(temperature=0.7, top_k=40, top_p=0.9, frequency_penalty=0.1)):
            self.run(Request([token] * 4, 4, sampler, ignore_eos=True))
        done = f"{captured} prompt graphs captured" if captured else "prompts run eagerly"
        return done + (f", {self.engine.batch_graphs} batched steps' graphs" if self.engine.batch_graphs else "")

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.n_ctx:
            raise ContextExceeded(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.")

    def run(self, req: Request, on_text: Callable[[str], None] | None = None,
            cancelled: Callable[[], bool] = lambda: False,
            on_logprobs: Callable[[TokenLogprob], None] | None = None) -> Completion:
        """Generates; `on_text` gets each final piece of text, `on_logprobs` each token's entry (when
        the request asks for logprobs) before the piece holding its text. `cancelled` is polled per token."""
        self.check_fits(len(req.prompt_ids), req.max_tokens)
        with self.engine.new_sequence() as seq:  # its slot in the engine's arena, given back after
            choice = Choice(self, req, seq, on_text, cancelled, on_logprobs)
            choice.prefill()
            while not choice.done:
                choice.take(self.engine.forward([choice.token], seq)[-1])
            return choice.completion()


class Choice:
    """One choice's generation, a token at a time: what Generator.run drives alone and the batch
    scheduler (batching.py) drives beside others. prefill() runs the prompt (in pieces, where a
    scheduler asks for them) and takes its first token; take(logits) samples the next token from
    a step's logits and settles its logprobs, text and stop conditions; `token` is then the next
    step's input, until `done`. The step that produced the logits is the caller's: one choice's
    tokens are the same whoever runs its steps (up to the steps' own rounding)."""

    def __init__(self, generator: Generator, req: Request, seq: Sequence,
                 on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] = lambda: False,
                 on_logprobs: Callable[[TokenLogprob], None] | None = None) -> None:
        self.engine = generator.engine
        self.req = req
        self.seq = seq
        self.cancelled = cancelled
        self.on_logprobs = on_logprobs
        self._counters = self.engine.expert_cache.counters if self.engine.expert_cache else None
        self._before = self._counters.snapshot() if self._counters else None
        self.usage = Usage(len(req.prompt_ids))
        self.text = _TextStream(generator.tokenizer, req.stop, on_text)
        self.stops = set() if req.ignore_eos else set(generator.tokenizer.stop_ids)
        self.finish_reason = "length"
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        self.text_before = 0  # characters decoded before the next token (logprobs' text_offset)
        self.counts: torch.Tensor | None = None
        self.prompt_done = 0  # prompt tokens run so far
        self.done = False
        self._unsettled: torch.Tensor | None = None  # the logits of a token taken but not settled
        self._start = time.perf_counter()

    @property
    def token(self) -> int:
        """The next step's input: the last token taken."""
        return self.ids[-1]

    def prefill(self, limit: int | None = None) -> None:
        """Runs the prompt, or its next `limit` tokens; its last piece takes the first token."""
        piece = self.next_piece(limit)
        if piece:
            self.piece_done(piece, self.engine.forward(piece, self.seq, last=True)[-1])

    def next_piece(self, limit: int | None = None) -> list[int]:
        """The prompt's next `limit` tokens (all that are left without one) for a step to run,
        or none where the client left while this request waited its turn (the choice is then done)."""
        if self.cancelled():
            self.finish_reason, self.done = "cancelled", True
            return []
        prompt = self.req.prompt_ids
        return prompt[self.prompt_done:len(prompt) if limit is None else self.prompt_done + limit]

    def piece_done(self, piece: list[int], logits: torch.Tensor) -> None:
        """A step ran `piece`, giving `logits` [V] after its last token; the last piece takes the first token."""
        self.prompt_done += len(piece)
        if self.prefilled:
            # On the logits' device, like the choice: updating it there keeps the step free of host copies.
            if self.req.sampler.penalizes:
                self.counts = torch.zeros(logits.numel(), dtype=torch.float32, device=logits.device)
            self.take(logits)

    @property
    def prefilled(self) -> bool:
        return self.prompt_done == len(self.req.prompt_ids)

    def take(self, logits: torch.Tensor, token: int | None = None, settle: bool = True) -> None:
        """The next token from this step's logits [V] (or `token`, chosen from them by the caller:
        a batch's greedy rows in one launch); `done` once a stop token or string, max_tokens or a
        cancellation ends the choice. With `settle` off the token's logprobs and text wait for
        settle(), which a scheduler calls once the next step is launched, off the GPU's path
        (a stop string found then ends the choice after that step: its row is not kept)."""
        if len(self.ids) >= self.req.max_tokens or self.cancelled():
            self._end()
            return
        if token is None:
            token = self.req.sampler(logits, self.counts)
        if not self.ids:
            sync_device(self.engine.device)
            self.usage.prefill_s = time.perf_counter() - self._start
            self._start = time.perf_counter()
        self.ids.append(token)
        if token in self.stops:
            self._end("stop")
            return
        if self.counts is not None:
            self.counts[token] += 1
        self._unsettled = logits
        if settle:
            self.settle()
        elif len(self.ids) >= self.req.max_tokens or self.cancelled():
            self._end()

    @property
    def unsettled(self) -> bool:
        """Whether the last token's logprobs and text are still to be handed out (settle())."""
        return self._unsettled is not None

    def settle(self) -> None:
        """The last token's logprobs and text, handed out; a stop string in the text ends the choice."""
        logits, self._unsettled = self._unsettled, None
        if logits is None:
            return
        if self.logprobs is not None:
            entry = token_logprob(logits, self.ids[-1], self.req.logprobs, self.text_before)
            self.logprobs.append(entry)
            if self.on_logprobs is not None:
                self.on_logprobs(entry)
            # A character still incomplete (its bytes split across tokens) starts after the next token.
            self.text_before = self.text.complete_length(self.ids)
        if self.text.add(self.ids):
            self._end("stop")
        elif len(self.ids) >= self.req.max_tokens or self.cancelled():
            self._end()

    def _end(self, reason: str | None = None) -> None:
        if reason is not None:
            self.finish_reason = reason
        self.done = True

    def completion(self) -> Completion:
        """The choice's result, once done."""
        self.settle()
        usage = self.usage
        usage.decode_s = time.perf_counter() - self._start if self.ids else 0.0
        usage.completion_tokens = len(self.ids)
        if self._counters:
            usage.cache = self._counters.since(self._before)
        text = "" if self.finish_reason == "cancelled" else self.text.finish(self.ids)
        return Completion(text, self.ids, self.finish_reason, usage, self.logprobs)


def token_logprob(logits: torch.Tensor, token: int, top: int, text_offset: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` ([V]) and the `top` most likely tokens: the
    log-softmax in float32 of exactly these logits."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()
    best: list[tuple[int, float]] = []
    if top:
        # topk's order among equal values is unspecified: take the ties at the edge too, then order them.
        values, ids = torch.topk(logp, min(logp.numel(), top))
        at_edge = torch.nonzero(logp == values[-1]).flatten().tolist()
        pairs = set(zip(ids.tolist(), values.tolist())) | {(i, float(values[-1])) for i in at_edge}
        best = sorted(pairs, key=lambda p: (-p[1], p[0]))[:top]
    return TokenLogprob(token, float(logp[token]), tuple(best), text_offset)


class _TextStream:
    """Turns the growing id list into text and hands out only text that cannot change any more.

    Incremental, so a token costs the same at the end of a long answer as at its start: only a short
    window of recent ids is decoded. `_read` marks the ids whose text is settled (`_stable`, which
    never ends in an incomplete character "\ufffd"); `_prefix` (the previous `_read`) starts the
    window one step earlier, so that decoders which treat a first token specially (SentencePiece's
    strip of a leading space) do so in both decodes and the difference between
    decode(ids[prefix:]) and decode(ids[prefix:read]) is the text after `_read` as the whole list
    decodes it. Stop strings are looked for in that new text and the last (longest stop - 1)
    characters before it: an earlier match would have been found at an earlier token.

    One decoder is not local: SentencePiece's byte fallback turns a whole run of byte tokens into one
    "\ufffd" each while the run ends in an incomplete character, rewriting characters it had already
    given. When the window's decode no longer starts with what its settled part gave, the whole list
    is decoded (`_whole`) until the run completes, so the text is always what decoding all ids gives
    (a run left invalid keeps the window inseparable: every later token then decodes all ids, the
    cost of the old stream, never a different text)."""

    def __init__(self, tokenizer: GGUFTokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.sent = 0  # characters handed out
        self.final: str | None = None
        self._overlap = max((len(s) for s in self.stop), default=1) - 1  # a stop string's start still held
        self._n_ids = 0  # ids decoded so far
        self._prefix = 0
        self._read = 0
        self._read_text = ""  # decode(ids[_prefix:_read])
        self._stable = ""  # the text of ids[:_read]: settled, never ends in "\ufffd"
        self._tail = ""  # the text of ids[_read:] as it decodes now: may change until it stops ending in "\ufffd"
        self._searched = 0  # characters of _stable that held no stop string at the last search
        self._whole: str | None = None  # the whole text, while the window's decode is not separable

    def _advance(self, ids: list[int]) -> None:
        """Decodes the ids added since the last call (ids only grow)."""
        if self._n_ids == len(ids):
            return
        self._n_ids = len(ids)
        window = self.tokenizer.decode(ids[self._prefix:])
        if not window.startswith(self._read_text):
            self._whole = self.tokenizer.decode(ids)
            return
        self._whole = None
        new = window[len(self._read_text):]
        if new and not new.endswith("\ufffd"):
            self._stable += new
            self._prefix, self._read = self._read, len(ids)
            self._read_text = self.tokenizer.decode(ids[self._prefix:self._read])
            self._tail = ""
        else:
            self._tail = new

    def _text(self, start: int, end: int) -> str:
        """Characters start..end of the whole text, without joining all of it."""
        if self._whole is not None:
            return self._whole[start:end]
        n = len(self._stable)
        if start >= n:
            return self._tail[start - n:end - n]
        return self._stable[start:end] + self._tail[:max(0, end - n)]

    def _length(self) -> int:
        """Characters of the whole text."""
        return len(self._whole) if self._whole is not None else len(self._stable) + len(self._tail)

    def _complete(self) -> int:
        """Characters of the text before a trailing incomplete UTF-8 sequence."""
        if self._whole is not None:
            return len(self._whole.rstrip("\ufffd"))
        return len(self._stable) + len(self._tail.rstrip("\ufffd"))

    def decoded(self, ids: list[int]) -> str:
        """The whole text of `ids`."""
        self._advance(ids)
        return self._whole if self._whole is not None else self._stable + self._tail

    def complete_length(self, ids: list[int]) -> int:
        """Characters of `ids`' text before an incomplete character (one that the next token completes)."""
        self._advance(ids)
        return self._complete()

    def add(self, ids: list[int]) -> bool:
        """True when a stop string appeared (the text is then cut before it)."""
        if not self.stop and self.on_text is None:
            return False  # nobody reads text before the end: decode once, in finish()
        self._advance(ids)
        if self.stop:
            start = 0 if self._whole is not None else max(0, self._searched - self._overlap)
            recent = self._text(start, self._length())
            hits = [at for at in (recent.find(s) for s in self.stop) if at >= 0]
            if hits:  # the earliest stop string wins, whichever comes first in the list
                self.final = self._text(0, start + min(hits))
                self._emit(len(self.final))
                return True
            if self._whole is None:
                self._searched = len(self._stable)
        safe = self._complete()  # an incomplete UTF-8 sequence waits: the next token completes it
        end = self._text(max(0, safe - self._overlap), safe)  # keep back a tail that may start a stop string
        hold = max((n for s in self.stop for n in range(1, min(len(s), safe + 1)) if end.endswith(s[:n])), default=0)
        self._emit(safe - hold)
        return False

    def finish(self, ids: list[int]) -> str:
        if self.final is None:
            self.final = self.decoded(ids)
            self._emit(len(self.final))
        return self.final

    def _emit(self, upto: int) -> None:
        """Hands out the text up to character `upto`, what of it was not handed out yet."""
        if upto > self.sent and self.on_text is not None:
            self.on_text(self._text(self.sent, upto))
        self.sent = max(self.sent, upto)


def sync_device(device: torch.device) -> None:
    """Waits for the work queued on `device` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
