"""`expert-worker`: loads a pack's trunk onto the device, connects to expertd (the pack's
fingerprint must match), sets up the expert cache, warms up, and serves the OpenAI-compatible API
until SIGTERM or Ctrl-C, then finishes the request in flight, leaves the daemon and exits 0."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import tomllib
from pathlib import Path

DESCRIPTION = """\
Serves a packed MoE model over an OpenAI-compatible HTTP API (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics). The trunk (everything but the routed
experts) lives on the device; the experts come from expertd, which must serve the same pack, into
a device cache. Settings come from --config FILE (TOML, keys as the flags with underscores) and
are overridden by flags."""

DEFAULTS = {
    "pack": None, "daemon": "ipc:///run/expertpack/expertd.sock", "device": None, "cache_vram_mib": 4096,
    "cache_reserve_mib": 1024, "host": "127.0.0.1", "port": 8000, "tokenizer": None, "model_name": None,
    "daemon_timeout_s": 30.0, "daemon_down_timeout_s": 60.0, "log_level": "info",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expert-worker", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file, e.g. /etc/expertpack/worker.toml")
    p.add_argument("--pack", type=Path, help="pack directory (trunk.gguf, manifest.json); required")
    p.add_argument("--daemon", metavar="ENDPOINT", help=f"expertd's endpoint (default {DEFAULTS['daemon']})")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
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
                        f"{DEFAULTS['daemon_timeout_s']:g})")
    p.add_argument("--daemon-down-timeout-s", type=float, metavar="S",
                   help=f"how long to keep reconnecting before a request fails (default "
                        f"{DEFAULTS['daemon_down_timeout_s']:g})")
    p.add_argument("--log-level", help="debug, info, warning (default info)")
    return p


def settings(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    merged = dict(DEFAULTS)
    if args.config is not None:
        try:
            table = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            p.error(f"{args.config}: {exc}")
        unknown = set(table) - set(DEFAULTS)
        if unknown:
            p.error(f"{args.config}: unknown keys {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}")
        merged.update(table)
    merged.update({k: v for k, v in vars(args).items() if v is not None and k in DEFAULTS})
    if merged["pack"] is None:
        p.error("--pack is required (or `pack` in the config file)")
    return argparse.Namespace(**merged)


def main(argv: list[str] | None = None) -> int:
    args = settings(argv)
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="expert-worker[%(process)d] %(levelname)s %(message)s")
    log = logging.getLogger("expert-worker")

    import torch  # after argument parsing: --help stays instant
    import uvicorn

    from expertpack.client import ClientError
    from expertpack.packtools.errors import ExpertpackError

    from .api import WorkerService, create_app
    from .cache_policy import CacheTooSmall
    from .engine import Engine
    from .generation import Generator
    from .tokenizer import TokenizerError, load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pack = Path(args.pack)
    name = args.model_name or pack.name
    start = time.perf_counter()
    try:
        engine = Engine.load(pack, device, daemon=args.daemon, cache_bytes=int(args.cache_vram_mib) << 20,
                             reserve_bytes=int(args.cache_reserve_mib) << 20, name=f"expert-worker:{name}",
                             daemon_timeout_s=float(args.daemon_timeout_s),
                             down_timeout_s=float(args.daemon_down_timeout_s))
        tokenizer = load_tokenizer(engine.files.metadata, args.tokenizer)
    except (ClientError, CacheTooSmall, ExpertpackError, TokenizerError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    try:
        generator = Generator(engine, tokenizer)
        engine.forward([tokenizer.bos_id or 0], engine.new_cache())  # warm-up: kernels, allocator, first experts
        cache = engine.expert_cache
        m = cache.manifest
        log.info("serving %s (%s, %d layers, %d experts top-%d) on %s: %d cache slots of %.2f MiB, %.0f MiB "
                 "resident, staging pinned: %s, context %d; loaded in %.1f s; http://%s:%d/v1",
                 name, engine.files.arch, m.model.n_layer, m.model.n_expert, m.model.n_expert_used, device,
                 cache.n_slots, cache.slot_bytes / 2**20, cache.resident_bytes / 2**20,
                 "yes" if cache.link.pinned else "no", generator.n_ctx, time.perf_counter() - start,
                 args.host, args.port)
        service = WorkerService(generator, name)
        app = create_app(service)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=int(args.port), log_level="warning",
                                               timeout_graceful_shutdown=60))
        # uvicorn handles SIGTERM/SIGINT (stop accepting, finish the request in flight), then
        # restores the handlers it found and raises the signal again: these make that a no-op, so
        # the daemon link is closed and the exit status is 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
        server.run()
        service.shutdown()  # the generation thread is done with the engine before it is closed
        log.info("stopped")
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
