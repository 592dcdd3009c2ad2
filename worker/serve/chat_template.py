"""The chat template a GGUF carries (`tokenizer.chat_template`, the model's own Jinja2 template),
rendered the way transformers renders it: a sandboxed environment with trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception` and `strftime_now`, and a `tojson`
that keeps non-ASCII text. Rendering it ourselves, rather than hard-coding formats, is what makes a
model's own conversation format come out right."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, broken, or refused these messages (its raise_exception)."""


class RenderedTooLong(ChatTemplateError):
    """The rendered text grew past the caller's bound; rendering stopped there."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the messages render to more than {max_chars:,} characters")
        self.max_chars = max_chars


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, metadata: dict[str, Any]) -> None:
        source = metadata.get("tokenizer.chat_template")
        if not source:
            raise ChatTemplateError("the model carries no chat template (tokenizer.chat_template); "
                                    "use /v1/completions with a formatted prompt")
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        self.bos_token, self.eos_token = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        try:
            self.template = _environment().from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               max_chars: int | None = None) -> str:
        """The template's text for `messages`; past `max_chars` characters it stops rendering and
        raises RenderedTooLong (a template may add far more text than the messages hold)."""
        pieces, n_chars = [], 0
        try:
            for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token):
                n_chars += len(piece)
                if max_chars is not None and n_chars > max_chars:
                    raise RenderedTooLong(max_chars)
                pieces.append(piece)
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from None
