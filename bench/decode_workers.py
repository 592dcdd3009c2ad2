#!/usr/bin/env python3
"""Aggregate decode speed of N worker processes, one per GPU, sharing one expertd (its reads and
its RAM tier), against one worker alone: issue 16, item 2.

Synthesizes and packs the preset as decode_streaming.py does (same defaults, same prompt and
pseudo-random decode stream), then runs twice, each time on a fresh expertd (a cold RAM tier):
(a) one worker alone on the first device, (b) N workers at once, worker i on device i. With
--distinct each worker decodes a stream of its own (its own prompt and tokens; the alone run is then
one run per stream, one after another, so that every worker's argmax has its reference); without,
all decode the same stream, the case where the RAM tier and the daemon's shared reads help most. Each worker
is a process of its own (this script with --child) with its own expert cache of --cache-gib, as
`expert-worker --device cuda:i` would be; they load, then all start together. Prints per worker
its prefill and decode tok/s, its VRAM cache hit rate, its RAM-tier hit rate and the SSD bytes read
for it (expertd's per-client counters over its decode), the stall per token and the hash of its
argmax at every step; then the aggregate decode tok/s (every worker's decoded tokens over the span
from the first decode start to the last decode end) against the alone run; then one JSON line.
Exit status 1 when any worker's argmax differs from the alone run's.

  python3 bench/decode_workers.py --workers 2 --layers 12 --cache-gib 1 --prompt 16 --decode 24   # cuda:0, cuda:1
  python3 bench/decode_workers.py --workers 2 --device cpu --preset tiny --cache-gib 0.002          # a check on CPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "ready"  # a child's stdout once its engine is loaded; it then waits for GO_LINE on stdin
GO_LINE = "go"
LOAD_TIMEOUT_S = 600.0


class WorkerFailed(RuntimeError):
    """A worker process exited or said something else than expected; the message has its log."""


# ---- one worker (the child process) -------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    """Loads an engine on one device against the daemon, says READY_LINE, waits for GO_LINE, runs
    decode_streaming's prefill + decode and prints one JSON line of results."""
    import torch

    from decode_streaming import run

    from expertpack.worker.engine.engine import Engine

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"bench-worker{args.index}[%(process)d] %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = f"bench-worker{args.index}[{os.getpid()}]@{args.device}"
    engine = Engine.load(args.pack, args.device, daemon=args.endpoint, cache_bytes=int(args.cache_gib * 2**30),
                         name=name)
    try:
        cache = engine.expert_cache
        marks: dict[str, dict] = {}

        def mark(phase: str) -> None:
            mine = cache.link.own_client(cache.link.stats())
            if mine is None:
                raise WorkerFailed(f"{name}: expertd's STATS has no client of this name (or did not answer)")
            marks[phase] = {"cache": cache.counters.snapshot(), "client": mine, "t": time.time()}

        print(READY_LINE, flush=True)
        if sys.stdin.readline().strip() != GO_LINE:
            return 1  # the parent went away
        prompt = stream_prompt(args.stream, args.prompt)
        result = run(engine, prompt, args.decode, args.device, mark, seed=args.stream)
        print(json.dumps({"index": args.index, "stream": args.stream, "device": args.device, "name": name,
                          "pid": os.getpid(), "slots": cache.n_slots, "slot_bytes": cache.slot_bytes,
                          "pinned": cache.link.pinned, **result, "marks": marks}), flush=True)
        return 0
    finally:
        engine.close()


def stream_prompt(stream: int, n: int) -> list[int]:
    """Stream 0's prompt is decode_streaming.py's (its hash compares with that bench's); others draw
    theirs from the first 1,000 token ids, which every preset has."""
    return list(range(100, 100 + n)) if stream == 0 else random.Random(1000 + stream).choices(range(100, 1000), k=n)


# ---- the parent ----------------------------------------------------------------------------------
def devices_for(spec: str, n: int) -> list[str]:
    """cpu: every worker on the CPU; cuda: worker i on cuda:i; or a list naming one device per worker."""
    if spec == "cpu":
        return ["cpu"] * n
    if spec == "cuda":
        return [f"cuda:{i}" for i in range(n)]
    devices = spec.split(",")
    if len(devices) != n:
        raise SystemExit(f"--device lists {len(devices)} devices for {n} workers; give one per worker, or cpu/cuda")
    return devices


def start_workers(args: argparse.Namespace, devices: list[str], streams: list[int], endpoint: str, logdir: Path,
                  run_name: str) -> list[dict]:
    """Starts one child per device, waits until all are loaded, starts them together, collects their
    results. Children are stopped (SIGTERM) on the way out whatever happens."""
    threads = max(1, (os.cpu_count() or 1) // len(devices)) if devices[0] == "cpu" else 0
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for i, device in enumerate(devices):
            log_path = logdir / f"{run_name}-worker{i}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, __file__, "--child", "--index", str(i), "--stream", str(streams[i]),
                     "--device", device, "--endpoint", endpoint, "--pack", str(args.pack), "--cache-gib",
                     repr(args.cache_gib), "--prompt", str(args.prompt), "--decode", str(args.decode),
                     "--threads", str(threads)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append((proc, log_path))
        for proc, log_path in procs:
            expect_line(proc, log_path, READY_LINE)
        for proc, _ in procs:
            proc.stdin.write(GO_LINE + "\n")
            proc.stdin.flush()
        results = []
        for proc, log_path in procs:
            line = proc.stdout.readline()
            if proc.wait(LOAD_TIMEOUT_S) != 0 or not line:
                raise WorkerFailed(f"worker exited {proc.returncode}; its log, {log_path}:\n{tail(log_path)}")
            results.append(json.loads(line))
        return results
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)


def expect_line(proc: subprocess.Popen, log_path: Path, want: str) -> None:
    line = proc.stdout.readline().strip()
    if line != want:
        proc.wait(60)
        raise WorkerFailed(f"worker exited {proc.returncode} before it was loaded; its log, {log_path}:\n"
                           f"{tail(log_path)}")


def tail(path: Path, n: int = 20) -> str:
    return "\n".join(path.read_text().splitlines()[-n:])


def decode_figures(r: dict, n_decode: int) -> dict:
    """One worker's decode phase: rates, its cache's hit rate, and expertd's counters for it."""
    (c0, d0), (c1, d1) = (r["marks"]["prefill"]["cache"], r["marks"]["prefill"]["client"]), \
        (r["marks"]["decode"]["cache"], r["marks"]["decode"]["client"])
    looked = (c1["hits"] - c0["hits"]) + (c1["misses"] - c0["misses"])
    ram_hits, ram_misses = d1["ram_hits"] - d0["ram_hits"], d1["ram_misses"] - d0["ram_misses"]
    tokens = n_decode - 1
    return {"device": r["device"], "stream": r["stream"], "prefill_tps": r["prefill_tps"],
            "decode_tps": r["decode_tps"],
            "vram_hit_rate": (c1["hits"] - c0["hits"]) / looked if looked else 0.0,
            "ram_hit_rate": ram_hits / (ram_hits + ram_misses) if ram_hits + ram_misses else 0.0,
            "ram_hits": ram_hits, "ram_misses": ram_misses,
            "ssd_bytes_per_token": (d1["read_bytes"] - d0["read_bytes"]) / tokens,
            "stall_s_per_token": (c1["stall_s"] - c0["stall_s"]) / tokens,
            "demand_p99_us": p99_between(d0["demand_latency_us"], d1["demand_latency_us"]),
            "decode_start": r["marks"]["prefill"]["t"], "decode_end": r["marks"]["decode"]["t"],
            "argmax_sha256": hashlib.sha256(json.dumps(r["tokens"]).encode()).hexdigest()[:16]}


def p99_between(before: dict, after: dict) -> float:
    """The 99th percentile (bucket's upper edge, us) of the demand fetches between two STATS: the
    difference of expertd's power-of-two histograms."""
    counts = [b - a for a, b in zip(before["buckets_log2_us"], after["buckets_log2_us"])]
    need, seen = 0.99 * sum(counts), 0
    for i, c in enumerate(counts):
        seen += c
        if c and seen >= need:
            return float(2 ** (i + 1))
    return 0.0


def aggregate_tps(figures: list[dict], n_decode: int) -> float:
    """Every worker's decoded tokens over the span from the first decode start to the last end:
    what the GPUs together delivered, not the sum of rates measured over different windows."""
    span = max(f["decode_end"] for f in figures) - min(f["decode_start"] for f in figures)
    return len(figures) * (n_decode - 1) / span


def one_run(args: argparse.Namespace, devices: list[str], streams: list[int], workdir: Path,
            run_name: str) -> list[dict]:
    from expertpack.bench import bench_io

    per_client = args.client_slots
    daemon = bench_io.DaemonProcess(args.pack, workdir, threads=8, splits=4, slots=per_client * len(devices),
                                    ram_cache_gib=args.ram_cache_gib, client_slots=per_client)
    try:
        results = start_workers(args, devices, streams, daemon.endpoint, workdir, run_name)
    finally:
        daemon.stop()
    return [decode_figures(r, args.decode) | {"slots": r["slots"], "slot_bytes": r["slot_bytes"],
                                               "pinned": r["pinned"]} for r in results]


def parent(args: argparse.Namespace) -> int:
    from decode_streaming import prepare_pack

    from expertpack.packtools.layout import Manifest

    devices = devices_for(args.device, args.workers)
    stem, args.pack = prepare_pack(args.preset, args.layers, args.dir)
    m = Manifest.load(args.pack)
    expert_bytes = sum(l.payload_bytes * m.model.n_expert for l in m.layers)
    # In the system temp directory: expertd's socket path there stays under the 107-byte limit.
    workdir = Path(tempfile.mkdtemp(prefix="decode-workers-"))
    print(f"logs in {workdir} (removed after a run whose argmax matched, unless --keep-logs)", file=sys.stderr)
    streams = list(range(args.workers)) if args.distinct else [0] * args.workers
    alone = [one_run(args, devices[:1], [s], workdir, f"alone{s}")[0] for s in sorted(set(streams))]
    together = one_run(args, devices, streams, workdir, "together")
    alone_tps = sum(f["decode_tps"] for f in alone) / len(alone)
    total_tps = aggregate_tps(together, args.decode)
    reference = {f["stream"]: f["argmax_sha256"] for f in alone}
    same = all(f["argmax_sha256"] == reference[f["stream"]] for f in together)

    ram = "expertd's default" if args.ram_cache_gib is None else f"{args.ram_cache_gib:g} GiB"
    print(f"model     {stem} ({expert_bytes / 1e9:.2f} GB of experts, {m.model.n_expert} x {len(m.layers)} layers, "
          f"top-{m.model.n_expert_used}); {args.workers} workers on {', '.join(devices)}, "
          f"{'a decode stream each' if args.distinct else 'all decoding the same stream'}")
    print(f"cache     {args.cache_gib:g} GiB per worker = {alone[0]['slots']} slots of "
          f"{alone[0]['slot_bytes'] / 2**20:.2f} MiB; expertd RAM tier: {ram}; {args.client_slots} staging slots "
          f"a worker; each run on a fresh expertd")
    print(f"{'run':<10}{'worker':<8}{'stream':<8}{'device':<8}{'prefill tok/s':>14}{'decode tok/s':>14}{'VRAM hit':>10}"
          f"{'RAM hit':>9}{'SSD MB/tok':>12}{'stall s/tok':>12}{'p99 ms':>8}  argmax")
    for run_name, figures in (("alone", alone), ("together", together)):
        for i, f in enumerate(figures):
            worker = i if run_name == "together" else "-"
            print(f"{run_name:<10}{worker:<8}{f['stream']:<8}{f['device']:<8}{f['prefill_tps']:14.2f}"
                  f"{f['decode_tps']:14.2f}{f['vram_hit_rate']:10.1%}{f['ram_hit_rate']:9.1%}{f['ssd_bytes_per_token'] / 1e6:12.1f}"
                  f"{f['stall_s_per_token']:12.3f}{f['demand_p99_us'] / 1000:8.1f}  {f['argmax_sha256']}")
    print(f"aggregate decode, {args.workers} workers together: {total_tps:.2f} tok/s = {total_tps / alone_tps:.2f}x "
          f"one worker alone ({alone_tps:.2f} tok/s{', the mean over the streams' if len(alone) > 1 else ''})")
    print(f"argmax at every step of every worker identical to the alone run: {same}")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    gpu = "none"
    if devices[0].startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(devices[0])
    print(json.dumps({
        "bench": "decode_workers", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu", "gpu": gpu, "devices": devices,
        "model": f"synth {args.preset}" + (f" --layers {args.layers}" if args.layers else ""),
        "expert_bytes": expert_bytes, "cache_bytes_per_worker": alone[0]["slots"] * alone[0]["slot_bytes"],
        "ram_cache_gib": args.ram_cache_gib, "client_slots": args.client_slots, "distinct": args.distinct,
        "prompt": args.prompt,
        "decode": args.decode, "alone": alone, "together": together,
        "aggregate_decode_tokens_per_s": round(total_tps, 3), "alone_decode_tokens_per_s": round(alone_tps, 3),
        "speedup": round(total_tps / alone_tps, 3), "argmax_identical": same}))
    if same and not args.keep_logs:
        shutil.rmtree(workdir)
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes in the shared run (default 2)")
    p.add_argument("--device", default=None,
                   help="cuda (worker i on cuda:i; the default where there is a GPU), cpu, or one device per "
                        "worker (cuda:1,cuda:0)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--cache-gib", type=float, default=1.0, help="expert cache per worker (default 1)")
    p.add_argument("--ram-cache-gib", type=float, default=None,
                   help="expertd's RAM tier (default: expertd's own, half the available memory; 0: none, every "
                        "miss read from the SSD)")
    p.add_argument("--client-slots", type=int, default=64, help="staging slots a worker leases (default 64)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded one at a time")
    p.add_argument("--distinct", action="store_true",
                   help="each worker decodes its own prompt and token stream (the alone run then runs each)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the workers' and expertd's logs after a run whose argmax matched (default: removed; "
                        "a run that failed keeps them)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--pack", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers < 1 or args.decode < 2 or args.prompt < 4 or args.cache_gib <= 0 or args.client_slots < 1:
        p.error("--workers and --client-slots at least 1, --decode at least 2, --prompt at least 4, --cache-gib > 0")
    # SIGTERM ends the run through the finally blocks: children stopped, expertd stopped, engine closed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.child:
        return child(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return parent(args)
    except WorkerFailed as exc:
        print(f"decode_workers: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
