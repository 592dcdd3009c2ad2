"""What an API request may say, checked before any work: the OpenAI request bodies as pydantic
models (null as absent, unknown fields refused, every field OpenAI defines either implemented or
refused by name unless it asks for nothing), the bounds on a body and its prompt sized from the
context, and ApiError, the OpenAI-shaped error every route answers with. Nothing here touches the
engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from ..engine.sampling import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS_VALUE, MAX_PENALTY


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Bounds that hold before a request costs anything: a body is refused from its Content-Length (or
# as soon as more arrives), a prompt from its characters before it is tokenized. Sized from the
# context unless configured: no token spans more than MAX_CHARS_PER_TOKEN characters of text in
# practice, and JSON escaping takes at most 6 bytes per character (\uXXXX).
MAX_CHARS_PER_TOKEN = 32
JSON_BYTES_PER_CHAR = 6
BODY_SLACK_BYTES = 1 << 20  # the rest of the request: messages' structure, stop strings, options


DEFAULT_MAX_QUEUE = 64  # requests waiting behind the ones generating; past them, 503 at once
DEFAULT_MAX_BATCH = 8  # choices decoded together (batching.BatchScheduler)


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int
    max_body_bytes: int
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH

    @classmethod
    def for_context(cls, n_ctx: int, max_prompt_chars: int = 0, max_body_bytes: int = 0,
                    max_queue: int = DEFAULT_MAX_QUEUE, max_batch: int = DEFAULT_MAX_BATCH) -> "Limits":
        """0 means: sized from the context (max_queue 0: no request waits)."""
        chars = max_prompt_chars or n_ctx * MAX_CHARS_PER_TOKEN
        return cls(chars, max_body_bytes or chars * JSON_BYTES_PER_CHAR + BODY_SLACK_BYTES, max_queue, max_batch)


class BodyTooLarge(HTTPException):
    """Raised from inside the body's reading, answered as ApiError 413 by the app."""


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 from its Content-Length, before
    anything is read, or (chunked) as soon as the bytes read pass the limit."""

    def __init__(self, app: Any, max_bytes: int, on_refused: Callable[[str], None]) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    def error(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.max_bytes:,} bytes, the most this worker accepts "
                             "(--max-body-mib; by default sized from the model's context)",
                        code="request_too_large")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            self.on_refused(scope["path"])
            response = JSONResponse(self.error().body(), status_code=413, headers={"Connection": "close"})
            return await response(scope, receive, send)
        seen = 0

        async def bounded() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(413, self.error().message)  # FastAPI passes HTTP errors through
            return message

        await self.app(scope, bounded, send)


MAX_N = 16  # choices per request; they run one after another
# Messages per chat (OpenAI's bound, 2048): counted before any is validated or rendered. However
# little each says, the template wraps each in text of its own, which no bound on the content's
# characters sees: empty messages by the ten thousand render to more tokens than a context holds.
MAX_MESSAGES = 2048
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs (its completions allow 5; this worker 20 too)
MAX_LOGIT_BIAS = 1024  # entries
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch's generator takes


def _never(value: Any) -> bool:
    return False


# Fields of OpenAI's API that this worker does not implement: refused with 400 naming the field,
# unless the value asks for nothing (some clients always send it: `"tools": []`, `"echo": false`).
NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v == [], "tool calling is not implemented by this worker"),
    "tool_choice": (lambda v: v == "none", 'tool calling is not implemented by this worker; only "none" is accepted'),
    "functions": (lambda v: v == [], "function calling is not implemented by this worker"),
    "function_call": (lambda v: v == "none",
                      'function calling is not implemented by this worker; only "none" is accepted'),
    "response_format": (lambda v: v == {"type": "text"},
                        'structured output (json_object, json_schema) is not implemented by this worker; only '
                        '{"type": "text"} is accepted'),
    "best_of": (lambda v: v == 1, "not implemented by this worker (n is: several choices, all returned); only 1"),
    "suffix": (lambda v: v == "", "insertion is not implemented by this worker"),
    "echo": (lambda v: v is False, "echoing the prompt is not implemented by this worker"),
    "audio": (_never, "audio output is not implemented by this worker"),
    "modalities": (lambda v: v == ["text"], 'only ["text"] is implemented by this worker'),
    "prediction": (_never, "predicted outputs are not implemented by this worker"),
    "reasoning_effort": (_never, "not implemented by this worker"),
    "web_search_options": (_never, "web search is not implemented by this worker"),
    "store": (lambda v: v is False, "this worker stores no completions; only false is accepted"),
    "service_tier": (lambda v: v in ("auto", "default"), 'service tiers are not implemented by this worker; only '
                                                         '"auto" and "default" are accepted'),
}
# Fields that only annotate a request and change nothing in its answer: accepted, not used.
# (parallel_tool_calls means something only with tools, which are refused.)
ANNOTATIONS = frozenset({"user", "metadata", "parallel_tool_calls"})


class _NullIsAbsent(BaseModel):
    """OpenAI's clients send null for an optional field they do not set: it means the default."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_NullIsAbsent):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CommonBody(_NullIsAbsent):
    # Fields beyond these are checked one by one (check_fields): refused, or accepted as annotations.
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]] | None = None
    ignore_eos: bool = False  # llama-server's and vLLM's extension: generate exactly max_tokens


class CompletionBody(CommonBody):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: each token's and the k most likely."""
        return self.logprobs


class ChatMessage(_NullIsAbsent):
    model_config = ConfigDict(extra="allow")  # refused field by field in chat(): the template sees role and content
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough(cls, value: Any) -> Any:
        """Before the messages are validated one by one (on the event loop)."""
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise PydanticCustomError("too_long", "{n} messages; at most {most} are taken",
                                      {"n": f"{len(value):,}", "most": f"{MAX_MESSAGES:,}"})
        return value

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_fields(body: CommonBody) -> None:
    """Every field beyond the implemented ones is refused (400 naming it) unless it asks for nothing
    or only annotates the request. Unknown fields are refused as OpenAI refuses them."""
    for name, value in (body.model_extra or {}).items():
        if name in ANNOTATIONS:
            continue
        if name in NOT_IMPLEMENTED:
            neutral, why = NOT_IMPLEMENTED[name]
            if not neutral(value):
                raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
            continue
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                       code="unknown_parameter")
