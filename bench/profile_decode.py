#!/usr/bin/env python3
"""Where a resident decode step's time goes: the kernel launches per step, the GPU's busy time
against the wall time, and the share of GPU time per class of kernel (the fused Triton kernels,
torch's elementwise ops, reductions, copies, cuBLAS, attention), from torch.profiler over a few
decode steps after a warm-up. Prints a table, then one JSON line.
  python3 bench/profile_decode.py MODEL.gguf [--steps 8] [--prompt 32] [--eager] [--prefill N]
With --prefill N it profiles `--steps` prompts of N tokens each (a fresh KV cache per prompt) instead.
`--setting "linear_tl.MATVEC_MAX_ROWS=32 ..."` first assigns worker constants as decode_settings.py does.
(synthesize one with `expertpack synth --preset qwen3-30b-a3b --layers 12 -o MODEL.gguf`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decode_settings import apply, parse_setting  # bench/, beside this script
from expertpack.worker.engine.engine import Engine

CLASSES = [  # (class, substrings of kernel names), first match wins
    ("grouped expert products (prefill)", ("_grouped_gate_up_kernel", "_grouped_down_kernel")),
    ("fused expert gate+up", ("_gate_up_kernel",)),
    ("fused expert down", ("_down_kernel",)),
    ("fused matvec (trunk)", ("_matvec_kernel", "_matvec_q8_0r_kernel")),
    ("dequantize (prefill, rows)", ("_dequant_kernel",)),
    ("dequantize (prefill, experts)", ("_dequant_blocks_kernel",)),
    ("fused attention", ("_partial_kernel", "_merge_kernel")),
    ("fused norms / rope", ("_rms_norm_kernel", "_add_rms_norm_kernel", "_rope_kernel")),
    ("cuBLAS / matmul", ("gemm", "gemv", "sgemm", "cublas", "cutlass", "xmma")),
    ("softmax / topk / sort", ("softmax", "topk", "sort", "radix", "bitonic")),
    ("reductions", ("reduce",)),
    ("copies / cat / index", ("copy", "cat", "index", "gather", "scatter", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def classify(name: str) -> str:
    low = name.lower()
    for label, needles in CLASSES:
        if any(n.lower() in low for n in needles):
            return label
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF (or pack directory)")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--eager", action="store_true",
                   help="launch every kernel from Python instead of replaying the step's CUDA graph")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="profile prompts of N tokens (a fresh cache each) instead of decode steps")
    p.add_argument("--setting", default="", metavar='"MODULE.CONST=INT ..."',
                   help="worker constants to assign first (bench/decode_settings.py's syntax)")
    args = p.parse_args(argv)
    apply(parse_setting(args.setting))
    engine = Engine.load(args.model, device="cuda", resident_experts=True)
    engine.graphs = not args.eager
    n_vocab = engine.forward([1], engine.new_sequence()).shape[-1]
    rng = random.Random(0)
    cache = engine.new_sequence()
    engine.forward(rng.choices(range(n_vocab), k=args.prompt), cache)
    for _ in range(3):  # warm-up: compilation, allocator
        engine.forward([rng.randrange(n_vocab)], cache)
    torch.cuda.synchronize()
    prompts = [rng.choices(range(n_vocab), k=args.prefill) for _ in range(args.steps)] if args.prefill else []
    if prompts:
        engine.forward(prompts[0], engine.new_sequence())  # warm-up of the prefill kernels
        torch.cuda.synchronize()
    feed = rng.choices(range(n_vocab), k=args.steps)
    argmax = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i, token in enumerate(feed):
            if prompts:
                argmax.append(int(engine.forward(prompts[i], engine.new_sequence(), last=True)[-1].argmax()))
            else:
                argmax.append(int(engine.forward([token], cache)[-1].argmax()))
        torch.cuda.synchronize()
        wall_s = (time.perf_counter() - t0) / args.steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_class: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for e in kernels:
        by_class[classify(e.name)] += e.device_time
        launches[classify(e.name)] += 1
    busy_us = sum(by_class.values()) / args.steps
    what = f"prefill of {args.prefill} tokens" if args.prefill else "decode step"
    print(f"model {args.model.name} ({'eager' if args.eager or args.prefill else 'CUDA graph'}): "
          f"{len(kernels) / args.steps:.0f} kernels per {what}, GPU busy {busy_us / 1000:.2f} ms of a "
          f"{wall_s * 1000:.2f} ms {what} ({max(1, args.prefill) / wall_s:.1f} tok/s)")
    print(f"{'class':32s} {'launches/step':>14s} {'GPU ms/step':>12s} {'share':>7s}")
    for label, us in by_class.most_common():
        print(f"{label:32s} {launches[label] / args.steps:14.0f} {us / args.steps / 1000:12.3f} "
              f"{us / max(1e-9, sum(by_class.values())):7.1%}")
    top = Counter()
    for e in kernels:
        top[e.name[:60]] += e.device_time
    print("top kernels:", "; ".join(f"{n} {us / args.steps / 1000:.3f} ms" for n, us in top.most_common(6)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    types = sorted({t.ggml_type.name for t in engine.files.trunk.values()})
    print(json.dumps({"bench": "profile_decode", "date": date.today().isoformat(), "commit": commit,
                      "model": args.model.name, "trunk_types": types,
                      "argmax_sha256": hashlib.sha256(str(argmax).encode()).hexdigest()[:16],
                      "steps": args.steps, "setting": args.setting, "eager": args.eager, "prefill": args.prefill,
                      "launches_per_step": len(kernels) / args.steps, "gpu_busy_ms": busy_us / 1000,
                      "wall_ms": wall_s * 1000, "gpu": torch.cuda.get_device_name(),
                      "classes": {k: {"launches": launches[k] / args.steps, "ms": v / args.steps / 1000}
                                  for k, v in by_class.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
