"""expertd's configuration: one dataclass, read from a TOML file (`--config`) and overridden by
flags; every key is also a flag (`stage_slots` <-> `--stage-slots`). Validated once, all problems
reported together."""

from __future__ import annotations

import argparse
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from expertpack.packtools.units import plain_number

DEFAULT_ENDPOINT = "ipc:///run/expertpack/expertd.sock"
LOG_LEVELS = ("debug", "info", "warning", "error")


# The range of every numeric key. Staging and the RAM tier are further capped at start by the host's
# memory (what the pack's block size makes of them is only known then). The heartbeat keys keep the ranges
# they had when they were ZeroMQ's (a 16-bit count of deciseconds), so that existing files still load.
RANGES: dict[str, tuple[float, float]] = {
    "stage_slots": (1, 1 << 20),
    "client_slots": (1, 1 << 20),
    "max_client_slots": (0, 1 << 20),
    "client_ram_holds": (1, 1 << 20),
    "client_ram_keeps": (0, 1 << 20),
    "read_threads": (1, 256),
    "read_splits": (1, 64),
    "ram_cache_gib": (0.0, 65536.0),
    "heartbeat_interval_s": (0.01, 600.0),
    "heartbeat_timeout_s": (0.02, 6553.0),
}


class ConfigError(ValueError):
    """A bad configuration file or flag; the message lists every problem."""


@dataclass(frozen=True)
class DaemonConfig:
    pack: Path | None = None  # the pack directory written by `expertpack build`
    endpoint: str = DEFAULT_ENDPOINT
    stage_slots: int = 64  # staging slots in shared memory, each one expert block (max stride)
    client_slots: int = 16  # slots leased to a client at HELLO unless it asks for another number
    # The most slots one client is granted, whatever its HELLOs ask, over all its sessions (a client is
    # its process over ipc, its CurveZMQ key over tcp): one peer cannot take the staging from the
    # others, however many connections it opens. 0: half of stage_slots, at least client_slots (see
    # client_slot_cap).
    max_client_slots: int = 0
    # RAM tier blocks one client may hold at once (READYs naming them not yet released), apart from
    # its staging: a worker's prefetches wait in the tier for their layer, six layers of a top-8
    # model ahead need ~100 of them. At most half the tier, so that one client cannot pin it, but
    # never fewer than the client's staging slots (the share before v6; see ram_hold_share).
    client_ram_holds: int = 256
    # RAM tier blocks one client may keep (protocol v8: holds its GPU reads in place, for as long as
    # its device table points at them), beside its holds, less its other sessions' keeps. 0: the tier
    # less the client's hold share, so that its holds and keeps together never pin more than the tier.
    # A kept block still serves every client; it is only never evicted. A worker alone on expertd
    # reads from the tier, where it can keep them, every expert its VRAM cache leaves out.
    client_ram_keeps: int = 0
    read_threads: int = 8
    read_splits: int = 4  # aligned pieces each block is read in, in parallel
    direct_io: bool = True  # False: buffered reads, counted in fallback_count
    # The RAM tier: GiB of hot expert blocks kept in the shared segment for every client (0: none).
    # None (the key absent): half of the memory the host has available at start, after the staging
    # and a 2 GiB margin, never more than the whole pack (ram_tier.ram_slot_count).
    ram_cache_gib: float | None = None
    # Liveness (protocol v4): WELCOME asks each client to send a message (HEARTBEAT when it has
    # nothing else to say) at least every heartbeat_interval_s; a session that sends nothing for
    # heartbeat_timeout_s (a frozen process) ends and its slots go to the others. A closed
    # connection loses them at once. At least twice the interval: a client beats when it has been
    # silent for one interval and looks every half interval.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    curve_secret_key_file: Path | None = None  # required for tcp:// endpoints (zmq_curve keypair file)
    log_level: str = "info"

    def problems(self) -> list[str]:
        out = []
        if self.pack is None:
            out.append("pack: no pack directory given (--pack DIR or `pack = ...` in the config file)")
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if value is None:  # a key whose default is computed at start
                continue
            if not (math.isfinite(value) and low <= value <= high):
                if low == 1 and value < 1 and isinstance(value, int):
                    out.append(f"{name}: must be at least 1, got {value}")
                else:
                    out.append(f"{name}: must lie in {plain_number(low)}..{plain_number(high)}, got {value!r}")
        if self.client_slots > self.stage_slots:
            out.append(f"client_slots ({self.client_slots}) cannot exceed stage_slots ({self.stage_slots})")
        if self.max_client_slots > self.stage_slots:
            out.append(f"max_client_slots ({self.max_client_slots}) cannot exceed stage_slots ({self.stage_slots})")
        if self.max_client_slots and self.client_slots > self.max_client_slots:
            out.append(f"client_slots ({self.client_slots}) cannot exceed max_client_slots ({self.max_client_slots})")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            out.append(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice heartbeat_interval_s "
                       f"({self.heartbeat_interval_s:g}): a live client may be silent for 1.5 intervals")
        if self.log_level not in LOG_LEVELS:
            out.append(f"log_level: one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        scheme = self.endpoint.split("://", 1)[0]
        if scheme not in ("ipc", "tcp"):
            out.append(f"endpoint: ipc:// or tcp://, got {self.endpoint!r}")
        if scheme == "tcp" and self.curve_secret_key_file is None:
            out.append("endpoint: a tcp:// endpoint needs curve_secret_key_file (CurveZMQ); "
                       "unencrypted TCP is refused")
        return out

    @property
    def client_slot_cap(self) -> int:
        """The slots one client (process, or CurveZMQ key) may hold over all its sessions:
        max_client_slots, or by default half the staging (a setting that gives each client more,
        client_slots, raises it to that)."""
        return self.max_client_slots or max(self.client_slots, self.stage_slots // 2)

    def ram_hold_share(self, n_slots: int, ram_slots: int, others: int = 0) -> int:
        """The RAM tier blocks a session leasing `n_slots` staging slots may hold at once:
        client_ram_holds, at most half the tier, less the shares of its client's other sessions
        (`others`: a process cannot pin more of the tier by opening more connections), never fewer
        than its staging slots (the share before the key existed, what a session needs to make
        progress); 0 without a tier."""
        return max(n_slots, min(self.client_ram_holds, ram_slots // 2) - others) if ram_slots else 0

    def ram_keep_share(self, ram_slots: int, hold_share: int, others: int = 0) -> int:
        """The RAM tier blocks a session may keep (v8): client_ram_keeps, at most the tier less its
        `hold_share` (the default), less the keeps of its client's other sessions (`others`)."""
        most = max(0, ram_slots - hold_share)
        return max(0, min(self.client_ram_keeps or most, most) - others)

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per key; defaults are None so that only flags actually given override the file."""
    helps = {
        "pack": "pack directory (manifest.json, experts.pack)",
        "endpoint": f"ZeroMQ endpoint to bind (default {DEFAULT_ENDPOINT})",
        "stage_slots": "staging slots in shared memory, each one expert block (default 64)",
        "client_slots": "slots leased to a client at HELLO that asks for no other number (default 16)",
        "max_client_slots": "the most slots one client (a process over ipc, a CurveZMQ key over tcp) is leased "
                            "over all its sessions, whatever its HELLOs ask (default 0: half of stage_slots, at "
                            "least client_slots)",
        "client_ram_holds": "RAM tier blocks one client may hold at once, its prefetches half of them (default 256; "
                            "at most half the tier, at least the client's staging slots)",
        "client_ram_keeps": "RAM tier blocks one client may keep for its GPU to read in place, beside its holds "
                            "(default 0: the tier less the client's hold share, also the most)",
        "read_threads": "reader threads issuing preadv (default 8)",
        "read_splits": "aligned pieces each expert block is read in (default 4)",
        "direct_io": "O_DIRECT reads (default on); --no-direct-io reads through the page cache",
        "ram_cache_gib": "GiB of RAM for hot expert blocks shared by every client, in the staging segment, locked "
                         "where the memlock limit allows (default: half the memory available at start after the "
                         "staging and a 2 GiB margin, at most the whole pack; 0: no RAM tier)",
        "heartbeat_interval_s": "how often each client must send a message, HEARTBEAT if nothing else (told at "
                                "WELCOME; default 1)",
        "heartbeat_timeout_s": "a client that sends nothing this long (frozen) loses its session and slots (default "
                               "10; at least twice the interval)",
        "curve_secret_key_file": "CurveZMQ secret key file; required for tcp:// endpoints",
        "log_level": f"one of {', '.join(LOG_LEVELS)} (default info)",
    }
    for f in fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps[f.name])
        else:
            kind = {"int": int, "float": float}.get(_plain(str(f.type)), str)
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=helps[f.name])


def load_config(path: Path | None, args: argparse.Namespace) -> DaemonConfig:
    values: dict[str, Any] = {}
    problems: list[str] = []
    known = {f.name: f for f in fields(DaemonConfig)}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        for key, value in data.items():
            if key not in known:
                problems.append(f"{path}: unknown key {key!r} (known: {', '.join(known)})")
            else:
                values[key] = value
    for name in known:
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = flag_value
    for name, value in list(values.items()):
        kind = _plain(str(known[name].type))
        try:
            values[name] = _coerce(kind, value)
        except (TypeError, ValueError):
            problems.append(f"{name}: expected {kind.replace(' | None', '')}, got {value!r}")
    if problems:
        raise ConfigError("; ".join(problems))
    config = DaemonConfig(**values)
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def _plain(kind: str) -> str:
    """The type of a key whose default is None (`float | None`: float); Paths keep their name."""
    return kind if "Path" in kind else kind.removesuffix(" | None")


def _coerce(kind: str, value: Any) -> Any:
    if "Path" in kind:
        return Path(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError
        return float(value)
    if not isinstance(value, str):
        raise TypeError
    return value
