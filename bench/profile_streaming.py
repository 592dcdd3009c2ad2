#!/usr/bin/env python3
"""Where a streaming decode step's time goes when the disk is out of the way: expertd's RAM tier
holds every expert the measured tokens need (a first pass over the same token stream reads them),
so what is left between the resident step and the streamed one is the worker's and the daemon's
own overhead (requests, copies, waits, Python). Measured side by side in one run, each decode one
token at a time through the KV cache:

  resident, CUDA graph      every expert on the device, the step replayed as a graph
  resident, eager           the same, every kernel launched from Python
  streaming, prefetch off   a VRAM cache of --cache-gib fed by expertd, the misses RAM-tier hits
  streaming, prefetch on    the same with the worker's lookahead
  streaming, ..., eager     the same with the engine's graphs off: every kernel launched from Python
                            (the streaming rows above take the engine's default: on CUDA, the step
                            as CUDA graphs split at the MoE layers, engine.SegmentedDecode)

then the host functions that took the most time in the last streaming run (cProfile, by own time).
  python3 bench/profile_streaming.py [--preset qwen3-30b-a3b] [--layers 12] [--cache-gib 1] [--tokens 16]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_streaming import REPO, prepare_pack, sync  # noqa: E402


def decode(engine, feed: list[int], device: str, profiler: cProfile.Profile | None = None) -> tuple[float, list[int]]:
    """Seconds per token of decoding `feed` one token at a time after a 4-token prompt, and the
    argmax of every step."""
    cache = engine.new_sequence()
    engine.forward(feed[:4], cache)
    sync(device)
    argmax = []
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    for token in feed[4:]:
        argmax.append(int(engine.forward([token], cache)[-1].argmax()))
    sync(device)
    per_token = (time.perf_counter() - t0) / (len(feed) - 4)
    if profiler is not None:
        profiler.disable()
    return per_token, argmax


def measured(engine, feed: list[int], device: str, n_tokens: int) -> tuple[float, list[int], dict]:
    """decode() over a streaming engine, with its cache's and expertd's counters over the run."""
    cache = engine.expert_cache
    before, read_before = cache.counters.snapshot(), cache.link.stats()["counters"]["pack_read_bytes"]
    per_token, argmax = decode(engine, feed, device)
    d = cache.counters.since(before)
    looked = d["hits"] + d["misses"]
    return per_token, argmax, {"hit_rate": d["hits"] / max(1, looked), "misses_per_token": d["misses"] / n_tokens,
                               "stall_ms_per_token": d["stall_s"] / n_tokens * 1000,
                               "ssd_bytes": cache.link.stats()["counters"]["pack_read_bytes"] - read_before}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--cache-gib", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=16, help="tokens decoded in each measured run")
    p.add_argument("--top", type=int, default=25, help="host functions listed")
    args = p.parse_args()

    from expertpack.bench import bench_io
    from expertpack.packtools.layout import Manifest
    from expertpack.worker.engine.engine import Engine

    stem, pack = prepare_pack(args.preset, args.layers, args.dir)
    m = Manifest.load(pack)
    expert_bytes = sum(l.payload_bytes * m.model.n_expert for l in m.layers)
    rows: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    engine = Engine.load(pack, args.device, resident_experts=True)
    n_vocab = engine.forward([1], engine.new_sequence()).shape[-1]
    feed = random.Random(0).choices(range(n_vocab), k=args.tokens + 4)
    for graphs in (True, False) if args.device.startswith("cuda") else (False,):
        engine.graphs = graphs
        decode(engine, feed[:8], args.device)  # warm-up: kernels, graph capture
        name = f"resident, {'CUDA graph' if graphs else 'eager'}"
        rows[name], tokens[name] = decode(engine, feed, args.device)
    engine.close()
    engine = None
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    workdir = Path(tempfile.mkdtemp(prefix="profile-streaming-"))
    stats: dict[str, dict] = {}
    kinds: dict[str, str] = {}  # streaming row -> how the engine ran its decode steps
    text = ""
    for prefetch in (False, True):
        name = f"streaming, prefetch {'on' if prefetch else 'off'}"
        daemon = bench_io.DaemonProcess(pack, workdir, threads=8, splits=4, slots=64,
                                        ram_cache_gib=expert_bytes * 1.05 / 2**30)
        try:
            engine = Engine.load(pack, args.device, daemon=daemon.endpoint, cache_bytes=int(args.cache_gib * 2**30),
                                 name="profile-streaming", prefetch=prefetch)
            decode(engine, feed, args.device)  # reads every key the measured pass needs into the RAM tier
            decode(engine, feed, args.device)  # captures what a step that misses nothing replays (TableDecode)
            rows[name], tokens[name], stats[name] = measured(engine, feed, args.device, args.tokens)
            graph = next(iter(engine._graphs.values()), None)  # the one slot's (one sequence at a time)
            kinds[name] = type(graph).__name__ if graph is not None else "eager"
            if engine._table_graphs:  # steps that found every expert ran from the cache's device table
                kinds[name] += "+TableDecode"
            if args.device.startswith("cuda"):  # the same, launched eagerly, for the ratio within this run
                engine.graphs = False
                eager = f"{name}, eager"
                rows[eager], tokens[eager], stats[eager] = measured(engine, feed, args.device, args.tokens)
                kinds[eager] = "eager"
                engine.graphs = True
            if prefetch:  # a pass of its own: the profiler slows Python about twofold
                profiler = cProfile.Profile()
                decode(engine, feed, args.device, profiler)
                out = io.StringIO()
                ps = pstats.Stats(profiler, stream=out)
                ps.sort_stats("tottime").print_stats(args.top)
                ps.sort_stats("cumulative").print_stats("expertpack", args.top)
                text = out.getvalue()
            engine.close()
            engine = None
        finally:
            daemon.stop()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    print(f"model {stem} on {args.device}, cache {args.cache_gib} GiB, RAM tier holding every expert; "
          f"{args.tokens} tokens decoded per run")
    print(f"{'':36}{'ms/token':>10}{'tok/s':>9}{'misses/token':>14}{'stall ms/token':>16}{'SSD bytes':>11}"
          f"  decode steps")
    for name, s in rows.items():
        st = stats.get(name)
        extra = (f"{st['misses_per_token']:14.1f}{st['stall_ms_per_token']:16.2f}{st['ssd_bytes']:11,}"
                 f"  {kinds[name]}" if st else "")
        print(f"{name:36}{s * 1000:10.2f}{1 / s:9.1f}{extra}")
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"argmax identical in every run: {same}")
    print("host time of a further streaming pass with prefetch (cProfile: by own time, then expertpack's by cumulative time):")
    print("\n".join(line for line in text.splitlines() if line.strip())[:9000])
    print(json.dumps({"bench": "profile_streaming", "date": date.today().isoformat(), "model": stem,
                      "machine": f"{os.uname().nodename} {os.cpu_count()} cpu", "device": args.device,
                      "cache_gib": args.cache_gib, "tokens": args.tokens,
                      "ms_per_token": {k: round(v * 1000, 3) for k, v in rows.items()}, "streaming": stats,
                      "decode_steps": kinds,
                      "argmax_identical": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
