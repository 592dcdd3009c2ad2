#!/usr/bin/env python3
"""Streaming against llama.cpp's best expert offload at the same VRAM and RAM (issue 13): llama.cpp
keeps the routed experts of its first K layers in host memory (`-ncmoe K`, read through mmap and
the page cache) and the rest on the GPU; expertpack keeps a VRAM expert cache, expertd's RAM tier
and the SSD. Both run under one RAM budget (a memory cgroup: bench/memory_budget.py, which charges
the page cache, shared memory and mlocked pages), the page cache dropped before each process.

The VRAM budget: llama.cpp's split K is one that fits it (the trunk and the GPU layers' experts,
from the pack's sizes, plus LLAMA_VRAM_MARGIN_GIB for its KV cache and buffers); K is swept over
every split that fits and the best decode counts. expertpack gets the same budget: the trunk (less
its token embedding, which the worker, like llama.cpp, keeps in host memory), a cache of the rest
less OUR_VRAM_MARGIN_GIB, and expertd's RAM tier of the RAM budget less
HOST_RESERVE_GIB (the worker's own host memory: CUDA's context, the trunk on its way in). With
--rounds N both sides run N times, alternately, and the table shows each one's median: one
llama-bench run of the split moved by 6% and more between runs on one machine (BENCHMARKS.md).
Prints a table and, last, one JSON line. Needs root (the cgroup) and a llama.cpp build
(bench/peer_llamacpp.py build).

  sudo python3 bench/peer_offload.py --bin /tmp/llama-build/bin --preset qwen3-30b-a3b --layers 12 \\
      --vram-gib 4 --ram-gib 8 [--ncmoe 4 8 12] [--pp 32] [--tg 32] [--reps 2] [--rounds 3] [--dir bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
LLAMA_VRAM_MARGIN_GIB = 1.0  # llama.cpp's KV cache and compute buffers beside the weights
OUR_VRAM_MARGIN_GIB = 1.0  # the worker's KV cache, activations and CUDA's own beside the trunk and cache
HOST_RESERVE_GIB = 4.0  # the worker's host memory and expertd's staging, out of the RAM budget


@dataclass(frozen=True)
class Split:
    ncmoe: int  # layers whose routed experts llama.cpp keeps in host memory
    vram_bytes: int  # what it then puts on the GPU, weights only
    host_expert_bytes: int  # the experts it reads from host memory (mmap, page cache)


def splits(gpu_trunk_bytes: int, expert_bytes_by_layer: dict[int, int], n_layer: int) -> list[Split]:
    """Every distinct -ncmoe K from 0 (all experts on the GPU) to n_layer (none): the experts of
    layers < K stay in host memory (K over leading dense layers moves nothing: the smallest such K
    stands for them). gpu_trunk_bytes: the trunk less its input embedding, which llama.cpp keeps
    in host memory whatever K is."""
    total = sum(expert_bytes_by_layer.values())
    out: list[Split] = []
    for k in range(n_layer + 1):
        host = sum(b for layer, b in expert_bytes_by_layer.items() if layer < k)
        if not out or host != out[-1].host_expert_bytes:
            out.append(Split(k, gpu_trunk_bytes + total - host, host))
    return out


def fitting(all_splits: list[Split], vram_bytes: int) -> list[Split]:
    """The splits whose weights and margin fit the VRAM budget."""
    return [s for s in all_splits if s.vram_bytes + LLAMA_VRAM_MARGIN_GIB * GIB <= vram_bytes]


def median_of_rounds(results: list[dict]) -> dict:
    """One side's runs (llama_run's or our_run's results) as one: each rate's median over the runs
    that measured it (a run that failed measured none), the largest memory peak, the OOM kills
    summed, the errors and the lowest hit rate kept, and every run's rates under "rounds"."""
    rates: dict[str, list[float]] = {}
    for r in results:
        for key, value in r["rates"].items():
            rates.setdefault(key, []).append(value)
    merged = {**results[-1], "rates": {k: statistics.median(v) for k, v in rates.items()},
              "peak_bytes": max(r["peak_bytes"] or 0 for r in results),
              "oom_kills": sum(r["oom_kills"] for r in results), "rounds": [r["rates"] for r in results]}
    merged.pop("error", None)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        merged["error"] = "; ".join(dict.fromkeys(errors))
    if any("hit_rate" in r for r in results):
        merged["hit_rate"] = min(r["hit_rate"] for r in results if "hit_rate" in r)
    return merged


def llama_run(bin_dir: Path, gguf: Path, split: Split, args: argparse.Namespace) -> dict:
    from expertpack.bench.memory_budget import run
    from expertpack.bench.peer_llamacpp import parse_llama_bench

    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-ncmoe", str(split.ncmoe),
           "-p", str(args.pp), "-n", str(args.tg), "-r", str(args.reps), "-o", "json"]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    result = run(cmd, int(args.ram_gib * GIB), capture=True, timeout_s=args.timeout_s)
    try:
        result["rates"] = parse_llama_bench(json.loads(result.pop("stdout") or "[]"))[0].tokens_per_s
    except (json.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
        result["rates"] = {}
        result["error"] = f"llama-bench printed no results ({exc})"
    return result


def our_run(args: argparse.Namespace, cache_gib: float, ram_tier_gib: float) -> dict:
    from expertpack.bench.memory_budget import run

    cmd = [sys.executable, str(REPO / "bench" / "decode_streaming.py"), "--preset", args.preset,
           *(("--layers", str(args.layers)) if args.layers else ()), "--dir", str(args.dir),
           "--cache-gib", f"{cache_gib:.3f}", "--ram-cache-gib", f"{ram_tier_gib:.3f}", "--skip-resident",
           "--prefetch", "on", "--prompt", str(args.pp), "--decode", str(args.tg),
           "--passes", "2"]  # warm, as llama-bench is: its warm-up run fills the page cache, ours the tiers
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    result = run(cmd, int(args.ram_gib * GIB), capture=True, timeout_s=args.timeout_s)
    lines = (result.pop("stdout") or "").strip().splitlines()
    try:
        report = json.loads(lines[-1])["streaming"]["prefetch_on"]
        result["rates"] = {f"pp{args.pp}": report["prefill_tokens_per_s"], f"tg{args.tg}": report["decode_tokens_per_s"]}
        result["hit_rate"] = report["decode"]["hit_rate"]
    except (IndexError, json.JSONDecodeError, KeyError) as exc:
        result["rates"] = {}
        result["error"] = f"decode_streaming printed no results ({exc}); its output ended: {lines[-5:]}"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", type=Path, required=True, help="llama.cpp's bin folder (llama-bench)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--dir", type=Path, default=REPO / "bench-out", help="where the model and its pack are made")
    p.add_argument("--vram-gib", type=float, required=True)
    p.add_argument("--ram-gib", type=float, required=True)
    p.add_argument("--ncmoe", type=int, nargs="+", help="the splits to try (default: every one that fits the VRAM)")
    p.add_argument("--pp", type=int, default=32)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--reps", type=int, default=2, help="llama-bench's repetitions of each test")
    p.add_argument("--rounds", type=int, default=1,
                   help="run llama.cpp's splits and expertpack this many times, alternately; report the medians")
    p.add_argument("--timeout-s", type=float, default=300, help="per process")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    from expertpack.bench.decode_streaming import prepare_pack
    from expertpack.packtools.gguf_source import open_source
    from expertpack.packtools.layout import Manifest

    stem, pack = prepare_pack(args.preset, args.layers, args.dir)
    gguf = args.dir / f"{stem}.gguf"
    m = Manifest.load(pack)
    by_layer = {layer.layer: layer.payload_bytes * m.model.n_expert for layer in m.layers}
    embedding = sum(t.nbytes for t in open_source(pack / m.trunk.file).tensors if t.name.startswith("token_embd."))
    candidates = fitting(splits(m.trunk.size_bytes - embedding, by_layer, m.model.n_layer), int(args.vram_gib * GIB))
    if args.ncmoe:
        candidates = [s for s in candidates if s.ncmoe in args.ncmoe]
    if not candidates:
        print(f"peer_offload: no -ncmoe split of {stem} fits {args.vram_gib:g} GiB of VRAM (the trunk alone is "
              f"{m.trunk.size_bytes / GIB:.2f} GiB)", file=sys.stderr)
        return 2
    cache_gib = args.vram_gib - (m.trunk.size_bytes - embedding) / GIB - OUR_VRAM_MARGIN_GIB
    one_layer = m.model.n_expert_used * max(layer.payload_bytes for layer in m.layers) / GIB
    if cache_gib < one_layer:
        print(f"peer_offload: {args.vram_gib:g} GiB of VRAM leaves expertpack a cache of {cache_gib:.2f} GiB after the "
              f"trunk (less its embedding) and a {OUR_VRAM_MARGIN_GIB:g} GiB margin, less than one layer's top-k "
              f"({one_layer:.2f} GiB)",
              file=sys.stderr)
        return 2
    ram_tier_gib = max(0.0, args.ram_gib - HOST_RESERVE_GIB)
    llama_rounds: list[list[dict]] = [[] for _ in candidates]
    our_rounds: list[dict] = []
    for n in range(args.rounds):
        if args.rounds > 1:
            print(f"peer_offload: round {n + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for runs, s in zip(llama_rounds, candidates):
            runs.append(llama_run(args.bin, gguf, s, args))
        our_rounds.append(our_run(args, cache_gib, ram_tier_gib))
    llama = [(s, median_of_rounds(runs)) for s, runs in zip(candidates, llama_rounds)]
    ours = median_of_rounds(our_rounds)

    tg, pp = f"tg{args.tg}", f"pp{args.pp}"
    print(f"model {stem}: trunk {m.trunk.size_bytes / GIB:.2f} GiB, experts {sum(by_layer.values()) / GIB:.2f} GiB; "
          f"budget {args.vram_gib:g} GiB VRAM, {args.ram_gib:g} GiB RAM (cgroup), page cache dropped before each run")
    print(f"{'':34}{'GPU weights':>12}{pp + ' tok/s':>12}{tg + ' tok/s':>12}{'RAM peak':>10}  notes")
    for s, r in llama:
        note = r.get("error", "") + (f" OOM-killed x{r['oom_kills']}" if r["oom_kills"] else "")
        print(f"{'llama.cpp -ncmoe ' + str(s.ncmoe):34}{s.vram_bytes / GIB:11.2f}G{r['rates'].get(pp, 0):12.2f}"
              f"{r['rates'].get(tg, 0):12.2f}{(r['peak_bytes'] or 0) / GIB:9.2f}G  {note}")
    print(f"{f'expertpack: cache {cache_gib:.2f}G, RAM tier {ram_tier_gib:.2f}G':34}{'':12}"
          f"{ours['rates'].get(pp, 0):12.2f}{ours['rates'].get(tg, 0):12.2f}{(ours['peak_bytes'] or 0) / GIB:9.2f}G  "
          f"{ours.get('error', '')}{' hit rate %.1f%%' % (100 * ours['hit_rate']) if 'hit_rate' in ours else ''}")
    best = max(llama, key=lambda sr: sr[1]["rates"].get(tg, 0))
    ratio = ours["rates"].get(tg, 0) / best[1]["rates"][tg] if best[1]["rates"].get(tg) else None
    print(f"decode: expertpack / llama.cpp's best split (-ncmoe {best[0].ncmoe}) = "
          + (f"{ratio:.2f}x" if ratio is not None else "-")
          + (f" (medians of {args.rounds} rounds)" if args.rounds > 1 else ""))
    round_ratios = [o[tg] / b[tg] if o.get(tg) and b.get(tg) else None  # a failed run's round has none
                    for o, b in zip(ours["rounds"], best[1]["rounds"])]
    if args.rounds > 1:
        print("decode ratio by round: " + ", ".join(f"{r:.2f}x" if r is not None else "-" for r in round_ratios))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"bench": "peer_offload", "date": date.today().isoformat(), "commit": commit, "model": stem,
                      "machine": f"{platform.node()} {os.cpu_count()} cpu", "gpu": _gpu_name(),
                      "vram_gib": args.vram_gib, "vram_budget": "arithmetic: the splits and the cache sized to it",
                      "ram_gib": args.ram_gib, "ram_budget": "a memory cgroup per process tree",
                      "start": "cold: page cache dropped before each process", "pp": args.pp, "tg": args.tg,
                      "rounds": args.rounds, "round_ratios": round_ratios,
                      "llama": [{"ncmoe": s.ncmoe, "gpu_weight_bytes": s.vram_bytes, **r} for s, r in llama],
                      "expertpack": {"cache_gib": cache_gib, "ram_tier_gib": ram_tier_gib, **ours},
                      "best_ncmoe": best[0].ncmoe, "decode_ratio": ratio}))
    return 0


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


if __name__ == "__main__":
    sys.exit(main())
