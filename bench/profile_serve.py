#!/usr/bin/env python3
"""Where the time between two streamed tokens goes in expert-worker, layer by layer of the serving
stack, on one pack and one expertd, every expert cached where the cache holds them all (the case
in which llama-server is the peer): each row adds one layer on top of the row before, so the
difference between two rows is what that layer costs a token.

  engine step                the engine's decode step and the argmax read back (Engine.forward)
  generator, no text         Generator.run: sampler, stop checks, usage (ignore_eos, greedy)
  generator, text streamed   the same handing each final piece of text to a callback (the detokenizer)
  the same, another thread   the same run on a thread of its own, as expert-worker runs generations
                             (off the thread that loaded the engine and warmed it up)
  expert-worker, HTTP        a real `expert-worker` process against the same expertd, one streamed
                             /v1/completions request at a time: the rate it reports (`timings`) and
                             the gaps between the chunks the client receives

then prompts: the engine's pass over a prompt of --prompt and of --long-prompt tokens with the
expert cache's host lookups and with its device table (a graph per short prompt length), and in
expert-worker the prompt time and time to first chunk of its first request after start-up (its
warm-up done before /health answered), a second, and a long prompt; then the host functions that
took the most time in the "text streamed" row (cProfile, own time).
The prompt is the same token ids everywhere; greedy tokens must agree across rows.

  python3 bench/profile_serve.py [--preset qwen3-30b-a3b] [--layers 12] [--cache-gib 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_streaming import REPO, prepare_pack, sync  # noqa: E402


def engine_rate(engine, prompt: list[int], n: int, device: str) -> tuple[float, list[int]]:
    """Seconds per decoded token of the bare engine loop, and its tokens (the prompt's argmax first)."""
    with engine.new_sequence() as seq:
        tokens = [int(engine.forward(prompt, seq, last=True)[-1].argmax())]
        sync(device)
        t0 = time.perf_counter()
        while len(tokens) < n:
            tokens.append(int(engine.forward([tokens[-1]], seq)[-1].argmax()))
        sync(device)
        return (time.perf_counter() - t0) / (n - 1), tokens


def generator_rate(generator, prompt: list[int], n: int, streamed: bool,
                   profiler: cProfile.Profile | None = None) -> tuple[float, list[int]]:
    """Seconds per decoded token as Generator.run reports them (its decode_s), and its tokens."""
    from expertpack.worker.engine.sampling import Sampler
    from expertpack.worker.serve.generation import Request

    pieces: list[str] = []
    req = Request(list(prompt), n, Sampler(), ignore_eos=True)
    if profiler is not None:
        profiler.enable()
    done = generator.run(req, pieces.append if streamed else None)
    if profiler is not None:
        profiler.disable()
    u = done.usage
    return u.decode_s / max(1, u.completion_tokens - 1), done.token_ids


def start_worker(pack: Path, endpoint: str, device: str, cache_gib: float, port: int, log_path: Path,
                 ) -> subprocess.Popen:
    """expert-worker as users start it, ready once /health answers."""
    exe = shutil.which("expert-worker") or str(Path(sys.executable).parent / "expert-worker")
    log = open(log_path, "w")
    proc = subprocess.Popen([exe, "--pack", str(pack), "--daemon", endpoint, "--device", device, "--port", str(port),
                             "--model-name", "profile", "--cache-vram-mib", str(int(cache_gib * 1024))],
                            stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"expert-worker exited ({proc.returncode}); see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"expert-worker did not answer /health in 600 s; see {log_path}")


def http_rate(port: int, prompt: list[int], n: int) -> tuple[float, float, float, float]:
    """One streamed /v1/completions request: (seconds per token the server reports, the median gap
    between the chunks after the first on the client's clock, the time to the first chunk on the
    client's clock, the prompt's seconds the server reports)."""
    body = {"model": "profile", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    arrivals: list[float] = []
    timings: dict = {}
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            timings = event.get("timings", timings)
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text"):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    per_token = timings["predicted_ms"] / 1000 / max(1, timings["predicted_n"] - 1)
    return (per_token, median(gaps) if gaps else float("nan"), arrivals[0] - sent if arrivals else float("nan"),
            timings["prompt_ms"] / 1000)


def prompt_time(engine, prompt: list[int], device: str, reps: int = 5) -> float:
    """Median seconds of the prompt's pass (logits of its last token) in a fresh sequence."""
    times = []
    for _ in range(reps):
        with engine.new_sequence() as seq:
            sync(device)
            t0 = time.perf_counter()
            engine.forward(prompt, seq, last=True)
            sync(device)
            times.append(time.perf_counter() - t0)
    return median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--cache-gib", type=float, default=8.0, help="the VRAM cache (8: every Q3-12L expert)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated in each measured run")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--long-prompt", type=int, default=200, help="tokens of the long prompt (eager shapes)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--top", type=int, default=20, help="host functions listed")
    args = p.parse_args()

    from expertpack.bench import bench_io
    from expertpack.packtools.layout import Manifest
    from expertpack.worker.engine.engine import Engine
    from expertpack.worker.serve.generation import Generator
    from expertpack.worker.serve.tokenizer import load_tokenizer

    stem, pack = prepare_pack(args.preset, args.layers, args.dir)
    m = Manifest.load(pack)
    expert_bytes = sum(l.payload_bytes * m.model.n_expert for l in m.layers)
    workdir = Path(tempfile.mkdtemp(prefix="profile-serve-"))
    rows: dict[str, float] = {}
    prompts: dict[str, tuple[float, int]] = {}  # name -> (seconds, prompt tokens)
    tokens: dict[str, list[int]] = {}
    daemon = bench_io.DaemonProcess(pack, workdir, threads=8, splits=4, slots=64,
                                    ram_cache_gib=expert_bytes * 1.05 / 2**30)
    try:
        engine = Engine.load(pack, args.device, daemon=daemon.endpoint, cache_bytes=int(args.cache_gib * 2**30),
                             name="profile-serve")
        engine.expert_cache.fill()
        tokenizer = load_tokenizer(engine.files.metadata, None)
        prompt = random.Random(0).choices(range(tokenizer.vocab_size), k=args.prompt)
        generator = Generator(engine, tokenizer)
        engine_rate(engine, prompt, args.tokens, args.device)  # warm-up: graphs, the prompt's graph
        long_prompt = random.Random(1).choices(range(tokenizer.vocab_size), k=args.long_prompt)
        for table in (False, True):  # the prompts through the host's lookups, then the device table's
            engine.table_steps = table
            for p_ids in (prompt, long_prompt):
                prompt_time(engine, p_ids, args.device, reps=2)  # captures, compiles
                prompts[f"engine prompt {len(p_ids)}, {'device table' if table else 'host lookups'}"] = (
                    prompt_time(engine, p_ids, args.device), len(p_ids))
        rows["engine step"], tokens["engine step"] = engine_rate(engine, prompt, args.tokens, args.device)
        rows["generator, no text"], tokens["generator, no text"] = generator_rate(generator, prompt, args.tokens, False)
        name = "generator, text streamed"
        rows[name], tokens[name] = generator_rate(generator, prompt, args.tokens, True)
        with ThreadPoolExecutor(1) as thread:
            name = "the same, another thread"
            rows[name], tokens[name] = thread.submit(generator_rate, generator, prompt, args.tokens, True).result()
        profiler = cProfile.Profile()
        generator_rate(generator, prompt, args.tokens, True, profiler)
        cache_stats = engine.expert_cache.stats()["cache"]
        engine.close()
        del engine, generator
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

        worker = start_worker(pack, daemon.endpoint, args.device, args.cache_gib, args.port, workdir / "worker.log")
        try:
            for i, p_ids in enumerate((prompt, prompt, long_prompt)):
                per_token, gap, ttft, prompt_s = http_rate(args.port, p_ids, args.tokens)
                name = ("first request after start-up", "second request", "a long prompt")[i]
                prompts[f"expert-worker {name}: prompt"] = (prompt_s, len(p_ids))
                prompts[f"expert-worker {name}: time to first chunk"] = (ttft, len(p_ids))
                if i == 0:
                    first = (per_token, gap)
                if i == 1:
                    second = (per_token, gap)
            per_token, gap = second
        finally:
            worker.terminate()
            worker.wait(60)
        rows["expert-worker, HTTP, first request (its timings)"] = first[0]
        rows["expert-worker, HTTP (its timings)"] = per_token
        rows["expert-worker, HTTP (client's chunk gaps)"] = gap
    finally:
        daemon.stop()

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"model {stem} on {args.device}, cache {args.cache_gib} GiB ({cache_stats.get('slots', '?')} slots), "
          f"prompt {args.prompt}, {args.tokens} tokens a run")
    print(f"{'':44}{'ms/token':>10}{'tok/s':>9}{'added ms':>10}")
    before = None
    for name, s in rows.items():
        added = "" if before is None else f"{(s - before) * 1000:10.3f}"
        print(f"{name:44}{s * 1000:10.3f}{1 / s:9.1f}{added}")
        if "client" not in name:
            before = s
    print(f"{'prompts':44}{'ms':>10}{'tok/s':>9}")
    for name, (sec, n_tok) in prompts.items():
        print(f"{name:44}{sec * 1000:10.3f}{n_tok / sec:9.1f}")
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"greedy tokens identical across the in-process rows: {same}")
    print("expert-worker's log, its last lines:")
    log_lines = (workdir / "worker.log").read_text().splitlines()
    print("\n".join([line for line in log_lines if "warmed up" in line] + log_lines[-4:]))
    print("host time of the generator, text streamed (cProfile, by own time):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    print(json.dumps({"bench": "profile_serve", "date": date.today().isoformat(), "model": stem,
                      "machine": f"{os.uname().nodename} {os.cpu_count()} cpu", "device": args.device,
                      "cache_gib": args.cache_gib, "tokens": args.tokens, "prompt": args.prompt,
                      "ms_per_token": {k: round(v * 1000, 4) for k, v in rows.items()},
                      "prompt_ms": {k: round(v[0] * 1000, 3) for k, v in prompts.items()}, "tokens_identical": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
