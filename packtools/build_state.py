"""The checkpoint a build leaves in its output directory so that a killed build resumes: the plan
it belongs to, how far the sequential copy got (shard, byte position at a tensor boundary), and the
hashes finished so far. Written atomically (temporary file, fsync, rename); the data it vouches for
is fdatasync'ed before it is written."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .gguf_source import Shard

STATE_FILE = ".expertpack-build.json"


@dataclass
class BuildState:
    plan_id: str
    placeholder: str  # the 64-character stand-in for the fingerprint inside trunk.gguf.partial
    trunk_size_bytes: int
    trunk_offsets: dict[str, int]
    shard: int = 0  # shards before this one are fully copied
    position: int = 0  # bytes of `shard` copied, always at a tensor boundary
    finished_copy: bool = False
    source_sha256: list[str] = field(default_factory=list)  # per fully copied shard
    trunk_sha256: dict[str, str] = field(default_factory=dict)
    layer_sha256: dict[int, list[str]] = field(default_factory=dict)  # fully hashed layers only
    layer_crc32: dict[int, list[int]] = field(default_factory=dict)  # the same layers' crc32s (absent in
    # a state written before format 1.1: those layers are read back and hashed again)

    def done_bytes(self, shards: tuple[Shard, ...]) -> int:
        return sum(s.size_bytes for s in shards[:self.shard]) + (self.position if self.shard < len(shards) else 0)

    def segment_done(self, shard: int, end: int) -> bool:
        return shard < self.shard or (shard == self.shard and end <= self.position)


def load_state(out: Path) -> BuildState | None:
    path = out / STATE_FILE
    try:
        data = json.loads(path.read_text())
        data["layer_sha256"] = {int(k): v for k, v in data["layer_sha256"].items()}
        data["layer_crc32"] = {int(k): v for k, v in data.get("layer_crc32", {}).items()}
        return BuildState(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError):
        # A state this builder cannot read is treated as no state: the build starts over.
        return None


def save_state(out: Path, state: BuildState) -> None:
    path = out / STATE_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_state(out: Path) -> None:
    (out / STATE_FILE).unlink(missing_ok=True)
