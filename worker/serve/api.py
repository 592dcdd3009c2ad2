"""The OpenAI-compatible HTTP API of expert-worker (FastAPI): /v1/completions and
/v1/chat/completions, streamed (server-sent events) or not, /v1/models, /health and /metrics.

Generations run on one thread that owns the engine (batching.BatchScheduler), so the event loop
(and /health, /metrics) keeps answering: up to --max-batch at once, decoded together step by step,
a request arriving meanwhile joining at the next step; up to --max-queue more wait their turn, and a
request past them gets 503 queue_full at once, with Retry-After (OpenAI's clients retry it),
rather than a wait nobody bounded. A request whose
client went away stops at its next token (or never starts); at shutdown every generation stops.
Bad requests get OpenAI-style errors (400 invalid_request_error, 404 for an unknown model). A
daemon that stays away fails the request waiting for it with 503 after --daemon-down-timeout-s,
and the server keeps serving; a request that comes while expertd does not answer or serves
another pack (what /health reports) gets 503 at once, never queued behind that wait. Request
bodies and prompts are bounded (sized from the context) before anything is parsed or tokenized,
and templates and tokenizing run off the event loop. Beside the standard `usage`, responses carry llama-server's
`timings` (so one benchmark client reads both) and an `expertpack` object: unique-key hit rate and
SSD bytes read.

The API says no instead of ignoring: `n`, logprobs (the model's distribution, see generation.py),
the penalties and `logit_bias` are implemented; every other field OpenAI defines is refused with
400 naming it unless its value asks for nothing (NOT_IMPLEMENTED), and unknown fields are refused
as OpenAI refuses them. A client that leaves before its answer is logged once, as 499."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from expertpack.client import ClientError, FetchFailed, FingerprintMismatch
from expertpack.client.expertctl import health as daemon_health
from expertpack.client.protocol import FailCode

from ..engine.sampling import Sampler
from ..experts.daemon_link import CorruptExpert, DaemonLost
from .batching import BatchScheduler
from .chat_template import ChatTemplate, ChatTemplateError, RenderedTooLong
from .generation import (Completion, ContextExceeded, Generator, Request as GenRequest, TokenLogprob, Usage,
                         sampling_temperature)
from .metrics import ServeCounters, render
from .requests import (MAX_CHARS_PER_TOKEN, MAX_LOGIT_BIAS, ApiError, BodyLimit, BodyTooLarge, ChatBody, CommonBody,
                       CompletionBody, Limits, check_fields)
from .tokenizer import TokenTexts

log = logging.getLogger("expert-worker")
MAX_ID_DIGITS = 20  # a token id's, in logit_bias keys: leading zeros allowed, int()'s limit far off



class WorkerService:
    """What the routes share: the generator, the model's name and template, the one generation
    thread, and the flag that stops every generation at shutdown."""

    def __init__(self, generator: Generator, model_name: str, limits: Limits | None = None) -> None:
        self.generator = generator
        self.model_name = model_name
        self.limits = limits or Limits.for_context(generator.n_ctx)
        self.counters = ServeCounters()
        self.scheduler = BatchScheduler(generator, self.limits.max_batch)
        # Templates and tokenizing run here, never on the event loop (nor behind a generation).
        self.text_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.stopping = threading.Event()
        try:
            self.template: ChatTemplate | None = ChatTemplate(generator.engine.files.metadata)
        except ChatTemplateError as exc:
            log.warning("%s; /v1/chat/completions will refuse requests", exc)
            self.template = None

    async def generate(self, req: GenRequest, n: int = 1, sink: Callable[[int, str, Any], None] | None = None,
                       gone: threading.Event | None = None) -> list[Completion]:
        """The request's n choices, one after another on the generation thread, each beside the
        other requests' (one sampler throughout: choice 0 is what n=1 gives). `sink(choice, kind,
        value)` gets ("logprob", TokenLogprob), ("text", piece) and ("done", Completion) as they
        happen. `gone` set: the client left; the choice in flight stops at its next token and no
        other starts."""
        gone = gone or threading.Event()
        cancelled = lambda: gone.is_set() or self.stopping.is_set()  # noqa: E731
        done: list[Completion] = []
        for i in range(n):
            if done and cancelled():
                break
            on_text = on_logprobs = None
            if sink is not None:
                on_text, on_logprobs = partial(sink, i, "text"), partial(sink, i, "logprob")
            try:
                done.append(await asyncio.wrap_future(self.scheduler.submit(req, on_text, cancelled, on_logprobs)))
            except asyncio.CancelledError:  # the awaiting task went (a server's shutdown): so does the choice
                gone.set()
                raise
            if sink is not None:
                sink(i, "done", done[-1])
        return done

    def admit(self) -> None:
        """Counts a request in for generation, or refuses it when the batch and the --max-queue
        waiting behind it are all taken; `leave` ends what this began."""
        batch = self.scheduler.max_batch
        if self.counters.in_flight >= batch + self.limits.max_queue:  # the event loop's count: no lock
            waiting = self.counters.in_flight - batch
            raise ApiError(503, f"the server is busy: {batch} generating (--max-batch {batch}) and {waiting} waiting, "
                                f"the most it queues (--max-queue {self.limits.max_queue}); retry later",
                           kind="server_error", code="queue_full", headers={"Retry-After": "1"})
        self.counters.in_flight += 1

    def leave(self) -> None:
        self.counters.in_flight -= 1

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.text_executor, fn, *args)

    def shutdown(self) -> None:
        """Stops the generations in flight at their next token and waits for them (the engine may
        then be closed); requests still queued are dropped with the server."""
        self.stopping.set()
        self.scheduler.shutdown()
        self.text_executor.shutdown(wait=True, cancel_futures=True)

    def daemon_stats(self) -> dict | None:
        cache = self.generator.engine.expert_cache
        return None if cache is None else cache.link.stats()

    def storage_refusal(self) -> ApiError | None:
        """Why a new request cannot be served now, asked of expertd now (STATS on the link's probe
        socket, beside any generation, as /health asks): it does not answer, or serves another
        pack. The request in flight waits for a daemon up to --daemon-down-timeout-s; one that
        comes meanwhile is answered at once instead of queued behind that wait."""
        cache = self.generator.engine.expert_cache
        if cache is None:
            return None
        link = cache.link
        stats = link.stats()
        if stats is None:
            return ApiError(503, f"expert storage unavailable: expertd at {link.endpoint} does not answer; requests "
                                 "are refused until it does (start it: systemctl start expertd)",
                            kind="server_error", code="daemon_unavailable")
        if wrong := link.other_pack(stats):
            return ApiError(503, f"expert storage unavailable: {wrong}", kind="server_error", code="daemon_wrong_pack")
        return None

    def daemon_endpoint(self) -> str:
        cache = self.generator.engine.expert_cache
        return "?" if cache is None else cache.link.endpoint

    def daemon_client(self) -> dict | None:
        """expertd's counters for this worker's own session (several workers may share the daemon)."""
        cache = self.generator.engine.expert_cache
        return None if cache is None else cache.link.own_client(cache.link.stats())



class _AdmittedStream(StreamingResponse):
    """A streamed answer that gives its place in the queue back however it ends: done, failed, or
    the client gone (starlette skips a response's background task then)."""

    def __init__(self, events: AsyncIterator[str], leave: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._leave = leave

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._leave()

def create_app(service: WorkerService) -> FastAPI:
    app = FastAPI(title="expert-worker", description="OpenAI-compatible API of an expertpack worker")
    app.add_middleware(BodyLimit, max_bytes=service.limits.max_body_bytes,
                       on_refused=lambda path: service.counters.count(path, 413))
    tokenizer = service.generator.tokenizer
    texts = TokenTexts(tokenizer)
    max_chars = service.limits.max_prompt_chars

    def too_long(what: str, param: str) -> ApiError:
        return ApiError(400, f"{what}; this worker takes at most {max_chars:,} (--max-prompt-chars; by default "
                             f"{MAX_CHARS_PER_TOKEN} per token of the {service.generator.n_ctx}-token context)",
                        param=param, code="context_length_exceeded")

    def check_chars(n_chars: int, param: str) -> None:
        if n_chars > max_chars:
            raise too_long(f"the prompt has {n_chars:,} characters", param)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        service.counters.count(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return await api_error(request, ApiError(413, exc.detail, code="request_too_large"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's and FastAPI's own refusals (an unknown path, a method, a body no JSON reader
        # takes) in OpenAI's shape, like ours.
        if exc.__cause__ is not None and exc.status_code == 400:
            message = f"the request body cannot be read as JSON: {_json_failure(exc.__cause__)}"
        else:
            message = f"{exc.detail} ({request.method} {request.url.path})"
        return await api_error(request, ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's doing: still an OpenAI-style body (starlette logs the traceback).
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request body"))
        return await api_error(request, ApiError(400, message, param=where))

    def check_request(body: CompletionBody | ChatBody) -> None:
        if body.model != service.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this worker serves "
                                f"`{service.model_name}`", param="model", code="model_not_found")
        check_fields(body)

    def gen_request(body: CompletionBody | ChatBody, prompt_ids: list[int], max_tokens: int | None) -> GenRequest:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= service.generator.n_ctx:
            raise ApiError(400, f"This model's maximum context length is {service.generator.n_ctx} tokens; the prompt "
                                f"alone has {len(prompt_ids)}.", param="messages", code="context_length_exceeded")
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
            raise ApiError(400, f"prompt token ids must lie in 0..{tokenizer.vocab_size - 1}", param="prompt")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop")
        max_tokens = max_tokens or min(16 if isinstance(body, CompletionBody) else 1 << 30,
                                       service.generator.n_ctx - len(prompt_ids))
        try:
            service.generator.check_fits(len(prompt_ids), max_tokens)
        except ContextExceeded as exc:
            raise ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded") from None
        seed = body.seed if body.seed is not None else random.getrandbits(63)  # unseeded: different each time
        temperature = sampling_temperature(body.temperature, body.top_p, tokenizer.vocab_size)  # 1e-320: greedy
        sampler = Sampler(temperature, body.top_k, body.top_p, seed, body.presence_penalty,
                          body.frequency_penalty, logit_bias(body.logit_bias))
        return GenRequest(prompt_ids, max_tokens, sampler, stop, body.ignore_eos, body.top_logprobs_asked())

    def logit_bias(biases: dict[str, float] | None) -> dict[int, float]:
        if not biases:
            return {}
        if len(biases) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(biases)}", param="logit_bias")
        out = {}
        for key, bias in biases.items():
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_ID_DIGITS) \
                    or not 0 <= int(key) < tokenizer.vocab_size:  # "²".isdigit(); int() reads 4300 digits at most
                shown = key if len(key) <= MAX_ID_DIGITS else f"{key[:MAX_ID_DIGITS]}... ({len(key):,} characters)"
                raise ApiError(400, f"logit_bias: keys are token ids in 0..{tokenizer.vocab_size - 1}, got {shown!r}",
                               param="logit_bias")
            out[int(key)] = bias
        return out

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        check_request(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_chars(len(prompt), "prompt")
            ids = await service.off_loop(tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        req = gen_request(body, ids, body.max_tokens)
        return await respond(request, body, req, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        check_request(body)
        if service.template is None:
            raise ApiError(400, "this model carries no chat template; use /v1/completions")
        for i, m in enumerate(body.messages):
            for name in m.model_extra or {}:  # the template is given role and content only
                raise ApiError(400, f"messages[{i}].{name}: message fields other than role and content are not "
                                    "implemented by this worker", param=f"messages[{i}].{name}",
                               code="unsupported_parameter")
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in body.messages]
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        template = service.template

        def render_and_encode() -> list[int]:
            try:
                text = template.render(messages, max_chars=max_chars)
            except RenderedTooLong as exc:
                raise too_long(f"{exc} (the chat template's text included)", "messages") from None
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            starts_with_bos = bool(template.bos_token) and text.startswith(template.bos_token)
            return tokenizer.encode(text, add_special=not starts_with_bos)

        ids = await service.off_loop(render_and_encode)
        req = gen_request(body, ids, body.max_completion_tokens or body.max_tokens)
        return await respond(request, body, req, "chat.completion", "chatcmpl")

    async def respond(request: Request, body: CommonBody, req: GenRequest, kind: str, prefix: str) -> Response:
        if (refused := await asyncio.to_thread(service.storage_refusal)) is not None:
            raise refused
        rid, created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "created": created, "model": service.model_name}
        shape = _Shape(kind == "chat.completion", req.logprobs is not None, texts)
        service.admit()
        if not body.stream:
            try:
                completions = await run_turn(request, req, body.n)
            finally:
                service.leave()
            choices = [shape.choice(i, c) for i, c in enumerate(completions)]
            return JSONResponse({**head, "object": kind, "choices": choices, **_usage_fields(completions)})
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = stream(request, head, kind + (".chunk" if shape.chat else ""), shape, req, body.n, include_usage)
        return _AdmittedStream(events, service.leave)

    async def run_turn(request: Request, req: GenRequest, n: int) -> list[Completion]:
        start = time.perf_counter()
        gone = threading.Event()
        watcher = asyncio.ensure_future(watch_disconnect(request, gone))
        try:
            completions = await service.generate(req, n, gone=gone)
        except (DaemonLost, ClientError) as exc:
            raise _storage_error(exc, service.daemon_endpoint()) from None
        except Exception as exc:
            log.exception("generation failed")
            raise ApiError(500, f"generation failed: {exc}", kind="server_error") from None
        finally:
            watcher.cancel()
        if gone.is_set():  # nobody will read the answer: counted as nginx's 499, said once in the log
            account(request.url.path, 499, completions, time.perf_counter() - start, req.max_tokens * n,
                    "the client disconnected before the answer; the generation stopped")
        else:
            account(request.url.path, 200, completions, time.perf_counter() - start)
        return completions

    async def watch_disconnect(request: Request, gone: threading.Event) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        gone.set()

    async def stream(request: Request, head: dict, kind: str, shape: "_Shape", req: GenRequest, n: int,
                     include_usage: bool) -> AsyncIterator[str]:
        pending: dict[int, list[TokenLogprob]] = {i: [] for i in range(n)}  # entries not yet sent, per choice

        def chunk(i: int, delta: str | None, finish: str | None = None, first: bool = False) -> dict:
            entries, pending[i] = pending[i], []
            logprobs = shape.logprobs(entries) if entries else None
            if shape.chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {} if delta is None else {"content": delta})
                choice = {"index": i, "delta": d, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            return {**head, "object": kind, "choices": [choice]}

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, str, Any] | None] = asyncio.Queue()
        gone = threading.Event()
        start = time.perf_counter()
        if shape.chat:
            for i in range(n):
                yield _sse(chunk(i, None, first=True))
        work = asyncio.ensure_future(service.generate(
            req, n, lambda *event: loop.call_soon_threadsafe(events.put_nowait, event), gone))
        work.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                i, what, value = event
                if what == "logprob":
                    pending[i].append(value)
                elif what == "text":
                    yield _sse(chunk(i, value))
                elif what == "done" and i < n - 1:  # the last choice's end goes out with the timings
                    yield _sse(chunk(i, None, value.finish_reason))
            completions = await work
        except Exception as exc:
            if isinstance(exc, (DaemonLost, ClientError)):
                error = _storage_error(exc, service.daemon_endpoint())
            else:
                log.exception("generation failed")
                error = ApiError(500, f"generation failed: {exc}", kind="server_error")
            service.counters.count(request.url.path, error.status)
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            gone.set()  # the client went away, or we are done: the generation stops at its next token
            if not work.done():  # the client left mid-stream: counted (as nginx's 499) once it stopped
                work.add_done_callback(lambda f: f.cancelled() or f.exception() or account(
                    request.url.path, 499, f.result(), time.perf_counter() - start, req.max_tokens * n,
                    "the client left the stream; the generation stopped"))
        account(request.url.path, 200, completions, time.perf_counter() - start)
        final = chunk(len(completions) - 1, None, completions[-1].finish_reason)
        yield _sse({**final, **{k: v for k, v in _usage_fields(completions).items() if k != "usage"}})
        if include_usage:
            yield _sse({**head, "object": kind, "choices": [], "usage": _usage_fields(completions)["usage"]})
        yield "data: [DONE]\n\n"

    def account(path: str, status: int, completions: list[Completion], seconds: float, asked: int = 0,
                note: str = "") -> None:
        c, u = service.counters, Usage.combined([x.usage for x in completions])
        c.count(path, status)
        c.prompt_tokens += u.prompt_tokens
        c.completion_tokens += u.completion_tokens
        c.request_seconds_sum += seconds
        c.request_seconds_count += 1
        c.prefill_seconds += u.prefill_s
        c.decode_seconds += u.decode_s
        log.info("%s %d: %d prompt + %d completion tokens, prefill %.1f tok/s, decode %.2f tok/s, hit rate %s, "
                 "%.1f MB of experts fetched%s", path, status, u.prompt_tokens, u.completion_tokens, u.prefill_tokens_per_s,
                 u.decode_tokens_per_s, "-" if u.hit_rate is None else f"{u.hit_rate:.1%}", u.fetched_bytes / 1e6,
                 f"; {note} after {u.completion_tokens} of the {asked} tokens asked for" if note else "")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "expertpack"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        cache = service.generator.engine.expert_cache
        if cache is None:
            return JSONResponse({"status": "ok"})
        stats = await asyncio.to_thread(service.daemon_stats)  # asked now, beside any generation
        if stats is None:
            return JSONResponse({"status": "degraded", "daemon": "unreachable"}, status_code=503)
        if wrong := cache.link.other_pack(stats):  # every request fails: the daemon refuses our sessions
            return JSONResponse({"status": "degraded", "daemon": "wrong_pack", "detail": wrong}, status_code=503)
        code, detail = daemon_health(stats)
        if code:
            return JSONResponse({"status": "degraded", "daemon": "degraded", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok", "daemon": "up"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        cache = service.generator.engine.expert_cache
        stats = None if cache is None else await asyncio.to_thread(cache.stats)
        mine = None if cache is None else await asyncio.to_thread(service.daemon_client)
        return PlainTextResponse(render(service.counters, stats and stats["cache"], stats and stats["daemon"],
                                        stats and stats.get("daemon_ram"), mine, service.scheduler.times),
                                 media_type="text/plain; version=0.0.4")

    return app


@dataclass(frozen=True)
class _Shape:
    """How one endpoint writes a choice and its logprobs: chat's `logprobs.content` entries with
    bytes and `top_logprobs`, or the completions endpoint's parallel lists."""
    chat: bool
    with_logprobs: bool
    texts: TokenTexts

    def choice(self, i: int, c: Completion) -> dict[str, Any]:
        logprobs = self.logprobs(c.logprobs or []) if self.with_logprobs else None
        if self.chat:
            return {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                    "logprobs": logprobs}
        return {"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        t = self.texts
        if self.chat:
            def one(token: int, logprob: float) -> dict[str, Any]:
                return {"token": t.text_of(token), "logprob": logprob, "bytes": list(t.bytes_of(token))}
            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(*p) for p in e.top]} for e in entries],
                    "refusal": None}
        tops = []
        for e in entries:
            top: dict[str, float] = {}
            for token, logprob in e.top:  # two tokens of one text: the more likely one's
                top.setdefault(t.text_of(token), logprob)
            tops.append(top)
        return {"tokens": [t.text_of(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": [e.text_offset for e in entries]}


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported (text only)",
                           param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _usage_fields(completions: list[Completion]) -> dict[str, Any]:
    u = Usage.combined([c.usage for c in completions])
    return {
        "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                  "total_tokens": u.prompt_tokens + u.completion_tokens},
        "timings": {"prompt_n": u.prompt_tokens, "prompt_ms": u.prefill_s * 1e3,
                    "prompt_per_second": u.prefill_tokens_per_s, "predicted_n": u.completion_tokens,
                    "predicted_ms": u.decode_s * 1e3, "predicted_per_second": u.decode_tokens_per_s},
        "expertpack": {"hit_rate": u.hit_rate, "fetched_bytes": u.fetched_bytes, "cache": u.cache},
    }


def _storage_error(exc: Exception, endpoint: str) -> "ApiError":
    """A failure of expert storage. The pack's fault, where retrying will not help and `expertpack
    verify` names the damage (500): a block corrupt on disk (expert_corrupt), or one expertd could
    not read (expert_unreadable: an I/O error, a pack truncated under it, or whatever FAIL code a
    newer daemon has for it). A daemon serving another pack refuses every session until one of
    them is restarted on the other's pack (503, daemon_wrong_pack); anything else is the daemon's
    absence (503, daemon_unavailable: retry later)."""
    if isinstance(exc, CorruptExpert):
        return ApiError(500, str(exc), kind="server_error", code="expert_corrupt")
    if isinstance(exc, FetchFailed) and exc.code not in (FailCode.SHUTDOWN, FailCode.CANCELLED):
        return ApiError(500, f"expert (layer {exc.key.layer}, expert {exc.key.expert}) could not be read from the pack "
                             f"by expertd at {endpoint}: {exc.code.name}: {exc.message}; the request fails and "
                             "retrying will not help: check the disk and run expertpack verify on the pack expertd "
                             "serves (rebuild or restore it if damaged)", kind="server_error", code="expert_unreadable")
    if isinstance(exc, FingerprintMismatch):
        return ApiError(503, f"expert storage unavailable: {exc}", kind="server_error", code="daemon_wrong_pack")
    return ApiError(503, f"expert storage unavailable: {exc}", kind="server_error", code="daemon_unavailable")


def _json_failure(exc: BaseException) -> str:
    """Why Python's JSON reader refused a body, for the client (not its advice to the server's
    programmer: "use sys.set_int_max_str_digits()")."""
    if isinstance(exc, RecursionError):
        return "arrays or objects nested too deeply"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):  # CPython says no more
        return f"a number has more than {sys.get_int_max_str_digits():,} digits"
    return f"{type(exc).__name__}: {exc}"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
