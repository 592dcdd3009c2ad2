#!/usr/bin/env python3
"""What a batched decode step (continuous batching's, Engine.decode_batch) costs as its rows grow,
in the two cases expert-worker serves: every expert resident (the step one CUDA graph), and every
expert in the expert cache's VRAM slots through expertd (one graph that looks the experts up in
the cache's device table, then the host reads back which it used). For each batch size B the
milliseconds of a step, read back as the scheduler reads it (each row's argmax), the tokens a
second that makes, and the same step with the slots {0..B-1} against a set missing one slot
(which replays the wider set's graph); then, for the cache at --profile-batch rows, the host
functions that took the most time (cProfile, own time). A step of B rows that costs B times one
row's is bound by something per row; one that costs about one row's is bound by launches.

With --mixed, continuous batching's step while prompts are admitted (Engine.mixed_step: pieces of
prompts beside the next token of B running sequences, eager), over the cache, against what it
replaces (each piece alone, as the scheduler runs one, then the B-row step), and the host
functions and GPU kernels of the last mixed case at --profile-batch rows: where its time goes.

  python3 bench/profile_batch.py [--preset qwen3-30b-a3b] [--layers 12] [--batches 1,2,4,8,16]
      [--settings "" "linear_tl.MATVEC_ROWS_PER_PROGRAM=1"]   (the resident case per setting)
      [--mixed 64,200,4x50]   (mixed steps of these prompt pieces, over the cache)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_settings import apply, module_of, parse_setting  # noqa: E402
from decode_streaming import REPO, prepare_pack, sync  # noqa: E402


def step_ms(engine, seqs: list, steps: int, device: str, profiler: cProfile.Profile | None = None) -> float:
    """Milliseconds per batched step over `seqs` (one sequence: its own step), each row's argmax
    read back and fed in as the next token, as the scheduler does."""
    tokens = [1 + i for i in range(len(seqs))]

    def one() -> None:
        nonlocal tokens
        if len(seqs) == 1:
            tokens = [int(engine.forward(tokens, seqs[0])[-1].argmax())]
        else:
            tokens = engine.decode_batch(seqs, tokens).argmax(-1).tolist()

    for _ in range(3):  # captures, first touches
        one()
    sync(device)
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    sync(device)
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    return elapsed / steps * 1000


KERNEL_STEPS = 4


def kernel_table(engine, b: int, top: int) -> str:
    """The GPU kernels of KERNEL_STEPS eager steps of b rows (the graphs' kernels, launched one by
    one so that the profiler sees each), by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    seqs = [engine.new_sequence() for _ in range(b)]
    graphs, engine.graphs = engine.graphs, False
    try:
        for seq in seqs:
            engine.forward([7, 8, 9], seq, last=True)
        step_ms(engine, seqs, 1, "cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step_ms(engine, seqs, KERNEL_STEPS, "cuda")
    finally:
        engine.graphs = graphs
        for seq in seqs:
            seq.close()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)


def mixed_ms(engine, seqs: list, piece: tuple[int, int], steps: int, device: str, mixed: bool,
             profiler: cProfile.Profile | None = None) -> float:
    """Milliseconds per step of `piece` (prompts, tokens each: new sequences each step) beside the
    next token of each of `seqs`: one mixed step, or (`mixed` off) each prompt alone then the
    batched step, the rows' argmax read back as the scheduler reads them."""
    tokens = [1 + i for i in range(len(seqs))]
    n, length = piece
    prompts = [[(5 + 3 * i + j) % 1000 + 1 for i in range(length)] for j in range(n)]

    def one() -> None:
        nonlocal tokens
        news = [engine.new_sequence() for _ in prompts]
        try:
            if mixed:
                out = engine.mixed_step(list(zip(news, prompts)), seqs, tokens)
                firsts, tokens = out[:n].argmax(-1).tolist(), out[n:].argmax(-1).tolist()
            else:
                firsts = [int(engine.forward(p, seq, last=True)[-1].argmax()) for seq, p in zip(news, prompts)]
                tokens = engine.decode_batch(seqs, tokens).argmax(-1).tolist()
        finally:
            for seq in news:
                seq.close()
        assert min(firsts) >= 0

    for _ in range(3):  # compiles, first touches
        one()
    sync(device)
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    sync(device)
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    return elapsed / steps * 1000


def measure_mixed(engine, batches: list[int], pieces: list[tuple[int, int]], steps: int, device: str, profile_at: int,
                  top: int) -> tuple[dict[str, dict[int, float]], cProfile.Profile, str]:
    """ms of a mixed step against the piece alone then the step, by batch size, for each piece;
    the host functions and (CUDA) the GPU kernels of the last piece's mixed step at profile_at rows."""
    out: dict[str, dict[int, float]] = {}
    profiler = cProfile.Profile()
    kernels = ""
    seqs = [engine.new_sequence() for _ in range(max(batches))]
    try:
        for seq in seqs:
            engine.forward([7, 8, 9], seq, last=True)
        for p in pieces:
            for mixed in (True, False):
                name = f"prompt {p[0]}x{p[1]} {'mixed with' if mixed else 'alone, then'} the B-row step"
                out[name] = {b: mixed_ms(engine, seqs[:b], p, steps, device, mixed) for b in batches if b > 1}
        mixed_ms(engine, seqs[:profile_at], pieces[-1], steps, device, True, profiler)
        if device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                mixed_ms(engine, seqs[:profile_at], pieces[-1], KERNEL_STEPS, device, True)
            kernels = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)
    finally:
        for seq in seqs:
            seq.close()
    return out, profiler, kernels


def measure(engine, batches: list[int], steps: int, device: str, profile_at: int | None
            ) -> tuple[dict[str, dict[int, float]], cProfile.Profile | None]:
    """ms a step for every batch size, over slots 0..B-1 and over them less slot 1 (B > 2)."""
    out: dict[str, dict[int, float]] = {"slots 0..B-1": {}, "less slot 1": {}}
    profiler = None
    seqs = [engine.new_sequence() for _ in range(max(batches))]
    try:
        for seq in seqs:
            engine.forward([7, 8, 9], seq, last=True)
        for b in batches:
            out["slots 0..B-1"][b] = step_ms(engine, seqs[:b], steps, device)
            if b > 2:
                out["less slot 1"][b] = step_ms(engine, seqs[:1] + seqs[2:b], steps, device)
        if profile_at is not None:
            profiler = cProfile.Profile()
            step_ms(engine, seqs[:profile_at], steps, device, profiler)
    finally:
        for seq in seqs:
            seq.close()
    return out, profiler


def piece(text: str) -> tuple[int, int]:
    """--mixed's TOKENS or NxTOKENS -> (prompts, tokens each)."""
    n, _, length = text.rpartition("x")
    return int(n or 1), int(length)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--cache-gib", type=float, default=8.0, help="the VRAM cache (8: every Q3-12L expert; 0: the resident cases only)")
    p.add_argument("--batches", default="1,2,4,8,16", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="steps timed per batch size")
    p.add_argument("--profile-batch", type=int, default=4, help="rows of the cache's step profiled")
    p.add_argument("--top", type=int, default=15, help="host functions (and GPU kernels) listed")
    p.add_argument("--settings", nargs="+", default=[""],
                   help='the resident case once per setting, each "module.CONSTANT=value ..." of worker/kernels '
                        'or worker (as decode_settings.py takes them; "" the defaults)')
    p.add_argument("--kernels", type=lambda v: [int(b) for b in v.split(",") if b], default=[1, 4],
                   help="batch sizes whose eager resident steps are profiled kernel by kernel (CUDA)")
    p.add_argument("--mixed", type=lambda v: [piece(n) for n in v.split(",") if n], default=[],
                   help="the prompt pieces of mixed steps timed over the cache, comma-separated: TOKENS (one "
                        "prompt) or NxTOKENS (N prompts of TOKENS each); none by default")
    args = p.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")})

    from expertpack.bench import bench_io
    from expertpack.packtools.layout import Manifest
    from expertpack.worker.engine.engine import Engine

    stem, pack = prepare_pack(args.preset, args.layers, args.dir)
    m = Manifest.load(pack)
    expert_bytes = sum(l.payload_bytes * m.model.n_expert for l in m.layers)
    results: dict[str, dict[str, dict[int, float]]] = {}
    kernel_tables: dict[str, str] = {}
    for text in args.settings:  # each with the defaults otherwise, side by side in this process
        setting = parse_setting(text)
        defaults = {key: getattr(module_of(key[0]), key[1]) for key in setting}
        apply(setting)
        try:
            engine = Engine.load(pack, args.device, resident_experts=True)
            case = "resident" + (f" [{text}]" if text else "")
            results[case], _ = measure(engine, batches, args.steps, args.device, None)
            print(f"{case}: " + "; ".join(f"{name} " + " ".join(f"{ms[b]:.3f}" for b in batches if b in ms)
                                          for name, ms in results[case].items()), file=sys.stderr, flush=True)
            if args.device.startswith("cuda"):
                kernel_tables |= {f"{b} rows{f' [{text}]' if text else ''}": kernel_table(engine, b, args.top)
                                  for b in args.kernels}
            engine.close()
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        finally:
            apply(defaults)
    kinds: list[str] = []
    profiler = mixed_profiler = None
    if args.cache_gib > 0:
        workdir = Path(tempfile.mkdtemp(prefix="profile-batch-"))
        daemon = bench_io.DaemonProcess(pack, workdir, threads=8, splits=4, slots=64,
                                        ram_cache_gib=expert_bytes * 1.05 / 2**30)
        try:
            engine = Engine.load(pack, args.device, daemon=daemon.endpoint, cache_bytes=int(args.cache_gib * 2**30),
                                 name="profile-batch")
            engine.expert_cache.fill()
            results["expert cache"], profiler = measure(engine, batches, args.steps, args.device, args.profile_batch)
            if args.mixed:
                results["expert cache, mixed"], mixed_profiler, kernel_tables["a mixed step"] = measure_mixed(
                    engine, batches, args.mixed, max(4, args.steps // 4), args.device, args.profile_batch, args.top)
            kinds = sorted({kind.__name__ for kind, _ in engine._batch_graphs})
            engine.close()
        finally:
            daemon.stop()
    print(f"model {stem} on {args.device}, {args.steps} steps a size; batched graphs of the cache: {kinds}")
    print(f"{'case':64}" + "".join(f"{f'B={b}':>10}" for b in batches))
    for case, by in results.items():
        for name, ms in by.items():
            print(f"{case + ', ' + name + ', ms':64}" + "".join(f"{ms[b]:10.3f}" if b in ms else f"{'':>10}"
                                                               for b in batches))
        ms = by.get("slots 0..B-1")
        if ms:
            print(f"{case + ', tokens/s':64}" + "".join(f"{b / ms[b] * 1000:10.1f}" for b in batches))
    for b, table in ((b, t) for b, t in kernel_tables.items() if t):
        what = f"{b} over the cache" if b == "a mixed step" else f"the resident step of {b}, eager"
        print(f"GPU kernels of {what}, {KERNEL_STEPS} steps (torch.profiler, {KERNEL_STEPS + 3} with the warm-up's):")
        print(table)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"host time of the cache's step of {args.profile_batch} rows, {args.steps} steps (cProfile, own time):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:5000])
    if mixed_profiler is not None:
        out = io.StringIO()
        pstats.Stats(mixed_profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        n, length = args.mixed[-1]
        print(f"host time of the mixed step of {n} pieces of {length} tokens and {args.profile_batch} rows "
              "(cProfile, own time):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:5000])
    print(json.dumps({"bench": "profile_batch", "date": date.today().isoformat(), "model": stem,
                      "machine": f"{os.uname().nodename} {os.cpu_count()} cpu", "device": args.device,
                      "ms_per_step": {case: {name: {str(b): round(v, 4) for b, v in ms.items()}
                                             for name, ms in by.items()} for case, by in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
