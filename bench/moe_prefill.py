#!/usr/bin/env python3
"""One MoE layer of a prefill, every way the worker can run it, by prompt length: per (token,
expert) pair (moe_tl, an expert's bytes decoded for every pair), in tiles (moe_tiles, decoded once
per tile of up to 4 pairs of one expert), dense (moe_dense, each selected expert dequantized
once and multiplied by all its tokens), for MXFP4 experts grouped (moe_grouped: dense's
products with each block of weights decoded on chip), for Q4_K experts integer (moe_integer: dense's
products as float16 products of the quants) and integer_tiles (the same products in tiles of a few
pairs, the quants decoded on chip: a batched decode step's shapes). Routing is uniform at random over the layer's experts;
each case is timed with triton.testing.do_bench, the results are compared with the per-pair one,
and the worker's own choice (moe.fused_path) is shown beside the fastest, to set its thresholds
from measurements. With --draws N each case cycles through N routings, so that its experts' bytes
come from HBM as a model's layers bring them, not from L2: one decode token's 8 experts of a
Qwen3-30B-A3B layer (21 MB) fit the H100's 50 MB L2, and timed alone they ran 1.3x faster there.
  python3 bench/moe_prefill.py MODEL.gguf [--tokens 2,4,8,16,32,64,128,256,512] [--draws 24]
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
from functools import partial
import itertools
import json
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.kernels import moe_dense, moe_grouped, moe_integer, moe_tiles, moe_tl
from expertpack.worker.nn.moe import fused_path
from expertpack.worker.nn.triton_ops import TritonOps
from kernel_bandwidth import bench_ms  # bench/ is on the path when this script runs


def cycling(calls: list) -> Callable[[], object]:
    """One call per invocation, round the list: each timed run meets the next routing."""
    at = itertools.count()
    return lambda: calls[next(at) % len(calls)]()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF (or pack directory)")
    p.add_argument("--tokens", default="2,4,8,16,32,64,128,256,512", help="prompt lengths, comma-separated")
    p.add_argument("--draws", type=int, default=1,
                   help="routings each case cycles through (24: the experts' bytes from HBM, not L2)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dev = torch.device("cuda")
    model = Engine.load(args.model, device="cuda", resident_experts=True).model
    moe = model.moe
    layer = min(moe._roles)
    roles, act = moe._roles[layer], moe.act(layer)
    layout = moe.source.layout(layer)
    table = moe.source.tables[layer]
    n_expert = table.numel() // layout.stride
    k_top = int(getattr(model.args, "n_expert_used"))
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        draws = [torch.stack([torch.randperm(n_expert, device=dev, generator=g)[:k_top] for _ in range(t)])
                 for _ in range(max(1, args.draws))]
        ids = draws[0]
        offsets = (ids.flatten() * layout.stride).contiguous()
        cycle = [(d.flatten() * layout.stride).contiguous() for d in draws]
        x = torch.randn(t, roles.gate.k, device=dev, generator=g)
        w = torch.rand(t * k_top, device=dev, generator=g)
        runs = {"per_pair": moe_tl.experts_per_pair, "tiles": moe_tiles.experts_in_tiles,
                "dense": moe_dense.experts_dense}
        if moe_grouped.decodes(roles):
            runs["grouped"] = partial(moe_grouped.experts_grouped, n_expert=n_expert)
        if moe_integer.runs(roles):
            runs["integer"] = partial(moe_integer.experts_integer, n_expert=n_expert)
            runs["integer_tiles"] = partial(moe_integer.experts_integer_tiles, n_expert=n_expert)
        want = moe_tl.experts_per_pair(x, table, offsets, w, roles, act)
        row = {"tokens": t, "experts": int(torch.unique(ids).numel()),
               "chosen": fused_path(ids, n_expert, moe_grouped.decodes(roles), TritonOps.experts_tiled(roles),
                                    moe_integer.runs(roles))}
        for name, run in runs.items():
            got = run(x, table, offsets, w, roles, act)
            row[f"{name}_rel_diff"] = ((got - want).norm() / want.norm()).item()
            row[f"{name}_ms"] = bench_ms(cycling([partial(run, x, table, o, w, roles, act) for o in cycle]))
        rows.append(row)
    print(f"model {args.model.name}, layer {layer}: {n_expert} experts, top-{k_top}, "
          f"{layout.stride} B per expert, {torch.cuda.get_device_name()}, {max(1, args.draws)} routings a case")
    print(f"{'tokens':>6} {'experts':>7} " + "".join(f"{name + ' ms':>12}" for name in runs)
          + f" {'fastest':>9} {'chosen':>9} {'max rel diff':>12}")
    for r in rows:
        fastest = min(runs, key=lambda name: r[f"{name}_ms"])
        diff = max(r[f"{name}_rel_diff"] for name in runs)
        print(f"{r['tokens']:>6} {r['experts']:>7} " + "".join(f"{r[name + '_ms']:>12.3f}" for name in runs)
              + f" {fastest:>9} {r['chosen']:>9} {diff:>12.1e}")
    print(json.dumps({"bench": "moe_prefill", "date": date.today().isoformat(), "model": args.model.name,
                      "gpu": torch.cuda.get_device_name(), "draws": max(1, args.draws), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
