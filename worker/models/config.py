"""Model hyper-parameters from GGUF metadata through one declarative table per architecture:
`{Args field: Key("<gguf key without the arch prefix>", default)}`. Read once, validated once,
every missing key reported at once; no `getattr(config, "x", default)` anywhere else."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

A = TypeVar("A")
REQUIRED = object()


class ConfigError(ValueError):
    """The GGUF lacks metadata the architecture needs; the message lists every missing key."""


@dataclass(frozen=True)
class Key:
    name: str  # without the "<arch>." prefix; "tokenizer.*" and "general.*" keys are taken as they are
    default: Any = REQUIRED


def read_args(cls: type[A], arch: str, metadata: dict[str, Any], table: dict[str, Key], **extra: Any) -> A:
    values: dict[str, Any] = dict(extra)
    missing: list[str] = []
    for field, key in table.items():
        full = key.name if key.name.startswith(("tokenizer.", "general.")) else f"{arch}.{key.name}"
        if full in metadata:
            values[field] = metadata[full]
        elif key.default is REQUIRED:
            missing.append(full)
        else:
            values[field] = key.default
    if missing:
        raise ConfigError(f"the GGUF lacks metadata the {arch} architecture needs: {', '.join(missing)}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(values) - names
    assert not unknown, f"{cls.__name__} has no fields {unknown}"
    return cls(**values)
