#!/usr/bin/env python3
"""Decode speed of a synthetic MoE model with every expert resident on the device: the compute floor
that expert streaming is measured against. Synthesizes the preset (Qwen3-30B-A3B shapes, Q4_K
experts, Q8_0 trunk by default) unless present, loads it with all experts on the device, prefills a
prompt and decodes greedily, timing each phase with the device synchronized.

Prints a table, then one JSON line with the conditions and a hash of the generated ids.
  python3 bench/decode_resident.py [--preset qwen3-30b-a3b] [--device cuda] [--dir bench-out]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded one at a time")
    args = p.parse_args()

    from expertpack.packtools.synth.writer import SynthOptions, write_synth
    from expertpack.worker.engine import Engine
    from expertpack.worker.sampling import Sampler

    args.dir.mkdir(parents=True, exist_ok=True)
    name = f"{args.preset}{f'-{args.layers}L' if args.layers else ''}.gguf"
    path = args.dir / name
    if not path.exists():
        print(f"synthesizing {path} ...", file=sys.stderr)
        write_synth(path, SynthOptions(preset=args.preset, n_layer=args.layers, progress=False))
    t0 = time.perf_counter()
    engine = Engine.load(path, args.device, resident_experts=True)
    sync(args.device)
    load_s = time.perf_counter() - t0
    prompt = list(range(100, 100 + args.prompt))
    engine.forward(prompt[:4], engine.new_cache())  # warm-up: kernels, allocator
    sync(args.device)

    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits = engine.forward(prompt, cache)
    sync(args.device)
    prefill_s = time.perf_counter() - t0
    sampler = Sampler()
    tokens = [sampler(logits[-1])]
    t0 = time.perf_counter()
    for _ in range(args.decode - 1):
        tokens.append(sampler(engine.forward([tokens[-1]], cache)[-1]))
    sync(args.device)
    decode_s = time.perf_counter() - t0
    decode_tps = (args.decode - 1) / decode_s
    vram = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"

    print(f"model    {name} ({path.stat().st_size / 1e9:.2f} GB), every expert resident on {args.device} ({gpu})")
    print(f"load     {load_s:8.1f} s   peak device memory {vram / 2**30:.1f} GiB")
    print(f"prefill  {args.prompt / prefill_s:8.2f} tokens/s  ({args.prompt} tokens in {prefill_s:.2f} s)")
    print(f"decode   {decode_tps:8.2f} tokens/s  ({args.decode - 1} tokens in {decode_s:.2f} s)")
    print(f"greedy ids sha256 {digest}")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({
        "bench": "decode_resident", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu", "gpu": gpu, "device": args.device,
        "torch": torch.__version__, "model": f"synth {args.preset}" + (f" --layers {args.layers}" if args.layers else ""),
        "model_bytes": path.stat().st_size, "cache": "all experts resident", "load_s": round(load_s, 2),
        "prefill_tokens_per_s": round(args.prompt / prefill_s, 3), "decode_tokens_per_s": round(decode_tps, 3),
        "peak_device_bytes": vram, "greedy_sha256": digest,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
