"""`expert-worker`: loads a pack's trunk onto the device, connects to expertd (the pack's
fingerprint must match), sets up the expert cache, warms up, and serves the OpenAI-compatible API
until SIGTERM or Ctrl-C, then finishes the request in flight, leaves the daemon and exits 0."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import socket
import sys
import time
import tomllib
from pathlib import Path

from expertpack.packtools.layout import MANIFEST_FILE, PACK_FILE, TRUNK_FILE
from expertpack.packtools.units import plain_number

DESCRIPTION = """\
Serves a packed MoE model over an OpenAI-compatible HTTP API (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics). The trunk (everything but the routed
experts) lives on the device; the experts come from expertd, which must serve the same pack, into
a device cache. Settings come from --config FILE (TOML, keys as the flags with underscores) and
are overridden by flags."""

DEFAULTS = {
    "pack": None, "daemon": "ipc:///run/expertpack/expertd.sock", "device": None, "cache_vram_mib": 4096,
    "cache_reserve_mib": 1024, "host": "127.0.0.1", "port": 8000, "tokenizer": None, "model_name": None,
    "daemon_timeout_s": 30.0, "daemon_down_timeout_s": 60.0, "max_body_mib": 0, "max_prompt_chars": 0,
    "max_queue": 64,  # requests.DEFAULT_MAX_QUEUE, not imported: fastapi loads once the settings are checked
    "max_batch": 0,  # what fits (serve/fitting.py)
    "log_level": "info", "trace": None, "trace_overwrite": False, "prefetch": True,
}


# Every numeric setting's type and range, checked (flags and config file alike) before torch loads.
RANGES: dict[str, tuple[type, float, float]] = {
    "cache_vram_mib": (int, 0, 1 << 24),  # 0: refused by the cache with the size it needs
    "cache_reserve_mib": (int, 0, 1 << 24),
    "port": (int, 1, 65535),
    "daemon_timeout_s": (float, 0.1, 3600.0),
    "daemon_down_timeout_s": (float, 0.0, 86400.0),
    "max_body_mib": (int, 0, 1 << 14),  # 0: sized from the context
    "max_prompt_chars": (int, 0, 1 << 31),
    "max_queue": (int, 0, 1 << 20),
    "max_batch": (int, 0, 1024),  # 0: what fits
}
LOG_LEVELS = ("debug", "info", "warning", "error")


class SettingsError(ValueError):
    """A bad flag or config file value; main prints it as one line and exits 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expert-worker", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file, e.g. /etc/expertpack/worker.toml")
    p.add_argument("--pack", type=Path, help="pack directory (trunk.gguf, manifest.json); required")
    p.add_argument("--daemon", metavar="ENDPOINT", help=f"expertd's endpoint (default {DEFAULTS['daemon']})")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one), or a list of GPUs "
                                     "(cuda:0,cuda:1): the layers are split in contiguous ranges over them, each GPU "
                                     "with an expert cache of --cache-vram-mib for its own layers")
    p.add_argument("--cache-vram-mib", type=int, metavar="N",
                   help=f"expert cache size in MiB (default {DEFAULTS['cache_vram_mib']}); the cache takes "
                        "min(N, free - reserve) and must hold one layer's top-k")
    p.add_argument("--cache-reserve-mib", type=int, metavar="N",
                   help=f"device memory left free for activations and the KV cache (default "
                        f"{DEFAULTS['cache_reserve_mib']})")
    p.add_argument("--host", help=f"address to listen on (default {DEFAULTS['host']})")
    p.add_argument("--port", type=int, help=f"port (default {DEFAULTS['port']})")
    p.add_argument("--tokenizer", type=Path, metavar="DIR", help="an HF tokenizer directory overriding the GGUF's")
    p.add_argument("--model-name", help="the model id clients ask for (default: the pack directory's name)")
    p.add_argument("--daemon-timeout-s", type=float, metavar="S",
                   help=f"a request expertd leaves unanswered this long counts as the daemon gone (default "
                        f"{DEFAULTS['daemon_timeout_s']:g}); only for a daemon that hangs: one that exits or "
                        "restarts is noticed at once and resumed as soon as it answers again")
    p.add_argument("--daemon-down-timeout-s", type=float, metavar="S",
                   help=f"a daemon gone this long fails the request waiting for it with 503 daemon_unavailable "
                        f"(default {DEFAULTS['daemon_down_timeout_s']:g}); until then the worker reconnects and "
                        "resumes as soon as a daemon answers")
    p.add_argument("--max-body-mib", type=int, metavar="N",
                   help="largest request body accepted, in MiB; larger ones get 413 before they are read "
                        "(default 0: sized from the context)")
    p.add_argument("--max-prompt-chars", type=int, metavar="N",
                   help="longest prompt accepted, in characters, checked before tokenizing (default 0: "
                        "32 per token of the context)")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help="requests generated together, their tokens decoded in one step (continuous batching: a "
                        "request joins at the next step, a finished one leaves); each holds its own KV memory "
                        "(default 0: as many as fit at the whole context in the memory the model and the expert "
                        "cache leave, up to 16, logged at start; architectures without batched steps run 1)")
    p.add_argument("--max-queue", type=int, metavar="N",
                   help="requests that may wait behind the ones generating; one more gets 503 queue_full with "
                        f"Retry-After at once (default {DEFAULTS['max_queue']}; 0: none waits)")
    p.add_argument("--log-level", help="debug, info, warning (default info)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="record the experts every token selects in every MoE layer (prompts and decoding) into "
                        "FILE, a routing trace for `expertpack bench cache` (format: worker/experts/routing_trace.py); "
                        "costs one host copy of the routing ids per layer call; an existing FILE is refused "
                        "unless --trace-overwrite")
    p.add_argument("--trace-overwrite", action="store_true", default=None,
                   help="let --trace replace an existing FILE (never one of the pack's own files)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="while a layer runs, fetch the experts the next layers will likely miss (the next layer's "
                        "router on the current state; DeepSeek-V4's hash layers exactly), so their reads overlap "
                        "compute; the logits are the same either way (default on)")
    return p


def settings(argv: list[str] | None) -> argparse.Namespace:
    """Flags over the config file over DEFAULTS; raises SettingsError listing every problem."""
    p = parser()
    args = p.parse_args(argv)
    merged = dict(DEFAULTS)
    if args.config is not None:
        try:
            table = tomllib.loads(args.config.read_text())
        except OSError as exc:
            raise SettingsError(f"{args.config}: cannot read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{args.config}: not valid TOML ({exc})") from None
        unknown = set(table) - set(DEFAULTS)
        if unknown:
            raise SettingsError(f"{args.config}: unknown keys {', '.join(sorted(unknown))}; known: "
                                f"{', '.join(DEFAULTS)}")
        merged.update(table)
    merged.update({k: v for k, v in vars(args).items() if v is not None and k in DEFAULTS})
    problems = []
    if merged["pack"] is None:
        problems.append("--pack is required (or `pack` in the config file)")
    for name, (kind, low, high) in RANGES.items():
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            problems.append(f"{name}: expected {kind.__name__}, got {value!r}")
        elif not (math.isfinite(value) and low <= value <= high):
            problems.append(f"{name}: must lie in {plain_number(low)}..{plain_number(high)}, got {value!r}")
    for name in ("pack", "daemon", "device", "host", "tokenizer", "model_name", "log_level", "trace"):
        if merged[name] is not None and not isinstance(merged[name], (str, Path)):
            problems.append(f"{name}: expected a string, got {merged[name]!r}")
    for name in ("prefetch", "trace_overwrite"):
        if not isinstance(merged[name], bool):
            problems.append(f"{name}: expected true or false, got {merged[name]!r}")
    if str(merged["log_level"]).lower() not in LOG_LEVELS:
        problems.append(f"log_level: one of {', '.join(LOG_LEVELS)}, got {merged['log_level']!r}")
    if isinstance(merged["trace"], (str, Path)) and isinstance(merged["pack"], (str, Path)):
        problem = trace_problem(Path(merged["trace"]), Path(merged["pack"]), merged["trace_overwrite"] is True)
        if problem:
            problems.append(f"trace: {merged['trace']}: {problem}")
    if problems:
        raise SettingsError("; ".join(problems))
    return argparse.Namespace(**merged)


# llama.cpp's split naming (llama_split_path): <prefix>-00001-of-00003.gguf
_SHARD = re.compile(r"^(?P<prefix>.+)-\d{5}-of-(?P<count>\d{5})\.gguf$")


def model_files(model: Path) -> list[Path]:
    """The files a model is made of: a pack directory's experts.pack, manifest.json and trunk.gguf,
    or a GGUF and, of a split set, every shard."""
    if model.is_dir():
        return [model / name for name in (PACK_FILE, MANIFEST_FILE, TRUNK_FILE)]
    m = _SHARD.match(model.name)
    if m is None:
        return [model]
    count = int(m["count"])
    return [model.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def trace_problem(trace: Path, model: Path, overwrite: bool) -> str | None:
    """Why --trace may not write `trace` (it opens it for writing, truncating), or None. A file
    that exists is replaced only when `overwrite` says so, and the model's own files never, by
    whatever path they are named (a link, `..`, a hard link): a trace written over experts.pack
    destroys the pack."""
    if not trace.parent.is_dir():
        return "its directory does not exist"
    if trace.is_dir():
        return "is a directory"
    for own in model_files(model):
        same = own.exists() and trace.exists() and os.path.samefile(own, trace)
        if same or own.resolve() == trace.resolve():
            return (f"is {own.name} of the model ({model}); a routing trace never replaces a model's own files, "
                    "--trace-overwrite or not")
    if trace.exists() and not overwrite:
        return "exists; --trace-overwrite replaces it"
    return None


def pick_device(requested: str | None) -> str:
    """cpu, cuda, cuda:N, or a list of GPUs (cuda:0,cuda:1) whose layers the worker splits
    (placement.py), checked against what this machine has (torch is imported by now); returned
    in canonical form."""
    import torch

    from ..nn.placement import DeviceSpecError, device_spec, parse_devices

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return device_spec(parse_devices(requested, n_cuda))
    except DeviceSpecError as exc:
        raise SettingsError(str(exc)) from None
    except ValueError:  # an index too long for int() or for torch's int64: cuda:999999999999999999999
        shown = requested if len(requested) <= 64 else requested[:60] + "..."
        raise SettingsError(f"--device {shown!r}: no such device; this process sees {n_cuda} CUDA devices"
                            + (f" (cuda:0..cuda:{n_cuda - 1})" if n_cuda else "")) from None


def client_name(model: str, device: str, pid: int) -> str:
    """The name this worker gives expertd at HELLO: `expert-worker[PID] MODEL@DEVICE`, as its log
    lines start, so that several workers on one daemon (one per GPU, same model) are told apart in
    `expertctl stats` and in expertd's log. Cut to the protocol's limit (a long model name would
    otherwise be refused at HELLO), the pid first so that it survives."""
    from expertpack.client.protocol import MAX_CLIENT_NAME

    printable = "".join(c if c.isprintable() else "?" for c in model)
    return f"expert-worker[{pid}] {printable}@{device}"[:MAX_CLIENT_NAME]


def main(argv: list[str] | None = None) -> int:
    try:
        args = settings(argv)
    except SettingsError as exc:
        print(f"expert-worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="expert-worker[%(process)d] %(levelname)s %(message)s")
    log = logging.getLogger("expert-worker")
    try:
        listener = bind_listener(str(args.host), int(args.port))
    except OSError as exc:
        log.error("cannot start: cannot listen on %s:%d (%s)", args.host, args.port, exc.strerror or exc)
        return 2
    try:
        return _serve(args, listener, log)
    finally:
        listener.close()


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the model loads so a port already taken is known at once;
    uvicorn listens on it once the worker is ready (until then connections are refused)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace, listener: socket.socket, log: logging.Logger) -> int:
    import uvicorn

    from expertpack.client import ClientError
    from expertpack.packtools.errors import ExpertpackError

    from ..engine.engine import Engine
    from ..experts.cache_policy import CacheTooSmall
    from ..experts.daemon_link import CorruptExpert
    from ..experts.routing_trace import start_trace, stop_trace
    from .api import WorkerService, create_app
    from .fitting import default_max_batch
    from .generation import Generator
    from .requests import Limits
    from .tokenizer import TokenizerError, load_tokenizer

    try:
        device = pick_device(args.device)
    except SettingsError as exc:
        log.error("cannot start: %s", exc)
        return 2
    pack = Path(args.pack)
    name = args.model_name or pack.name
    start = time.perf_counter()
    try:
        engine = Engine.load(pack, device, daemon=args.daemon, cache_bytes=int(args.cache_vram_mib) << 20,
                             reserve_bytes=int(args.cache_reserve_mib) << 20,
                             name=client_name(name, device, os.getpid()),
                             daemon_timeout_s=float(args.daemon_timeout_s),
                             down_timeout_s=float(args.daemon_down_timeout_s), prefetch=args.prefetch)
        tokenizer = load_tokenizer(engine.files.metadata, args.tokenizer)
    except (ClientError, CacheTooSmall, ExpertpackError, TokenizerError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    try:
        generator = Generator(engine, tokenizer)
        try:
            if engine.expert_cache is not None:  # where the model fits VRAM and the RAM tier: every expert read once
                engine.expert_cache.fill()
        except CorruptExpert as exc:  # it fails the requests that need it; the experts not read yet come with use
            log.error("reading every expert at start: %s", exc)
        if not args.max_batch:
            args.max_batch, why = default_max_batch(engine, generator.n_ctx)
            log.info("--max-batch %d: %s", args.max_batch, why)
        try:  # before /health says ready: the first request then pays no compiling nor capturing
            warmed = time.perf_counter()
            log.info("warming up: kernels, the decode step's graphs, short prompts' and batched steps' graphs")
            done = generator.warm_up(int(args.max_batch))
            log.info("warmed up in %.1f s: %s", time.perf_counter() - warmed, done)
        except CorruptExpert as exc:  # the pack's damage fails the requests that need it; /health says degraded
            log.error("warm-up: %s", exc)
        trace = None
        if args.trace is not None:  # after the warm-up: the trace holds what clients asked for
            try:
                trace = start_trace(engine, args.trace, name)
            except OSError as exc:
                log.error("cannot start: --trace %s: %s", args.trace, exc.strerror or exc)
                return 2
            log.info("recording routing into %s", args.trace)
        if engine.place.split:
            ranges = engine.layer_ranges
            log.info("layers split over %d devices: %s", len(ranges),
                     ", ".join(f"{d} {r.start}..{r.stop - 1}" for d, r in zip(engine.place.devices, ranges)))
        cache = engine.expert_cache
        m = cache.manifest
        log.info("serving %s (%s, %d layers, %d experts top-%d) on %s: %d cache slots of %.2f MiB, %.0f MiB "
                 "resident, staging pinned: %s, %d staging slots of expertd as client %r, prefetch %s, context %d; "
                 "loaded in %.1f s; http://%s:%d/v1",
                 name, engine.files.arch, m.model.n_layer, m.model.n_expert, m.model.n_expert_used, device,
                 cache.n_slots, cache.slot_bytes / 2**20, cache.resident_bytes / 2**20,
                 "yes" if cache.link.pinned else "no", cache.link.n_staging_slots, cache.link.name,
                 "on" if args.prefetch else "off", generator.n_ctx, time.perf_counter() - start, args.host, args.port)
        limits = Limits.for_context(generator.n_ctx, int(args.max_prompt_chars), int(args.max_body_mib) << 20,
                                    int(args.max_queue), int(args.max_batch))
        service = WorkerService(generator, name, limits)
        log.info("generating up to %d requests together, %d more queued", service.scheduler.max_batch,
                 limits.max_queue)
        app = create_app(service)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=int(args.port), log_level="warning",
                                               timeout_graceful_shutdown=60))
        # uvicorn handles SIGTERM/SIGINT (stop accepting, finish the request in flight), then
        # restores the handlers it found and raises the signal again: these make that a no-op, so
        # the daemon link is closed and the exit status is 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
        server.run(sockets=[listener])
        service.shutdown()  # the generation thread is done with the engine before it is closed
        if trace is not None:
            stop_trace(engine, trace)
            log.info("routing trace: %d layer calls in %s", trace.calls, args.trace)
        log.info("stopped")
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
