"""`expertpack bench cache TRACE`: replays a routing trace (`expert-worker --trace`, `expertpack eval
--trace`) against cache policies at several sizes and prints their hit rates side by side:

  LRU      evict the least recently selected expert
  LFU      evict the expert selected least often while resident (its count starts over when it
           comes back), the least recent among equals
  freq     the policy's frequency rule alone (LRFU: uses fading with a half-life of 32 cache fills,
           the least recent among equals), which was the policy in use until 2026-12-01
  in use   the worker's own CachePolicy (worker/experts/cache_policy.py), driven as the expert cache drives it:
           the frequency rule or LRU, whichever's shadow cache has hit more lately
  LFU*     LFU told each expert's count over the whole trace up front (offline): keeps the most
           popular; where tokens route independently no online policy does better on average
  Belady   the offline optimum: evict the resident expert whose next use lies furthest ahead
           (exact: next-use positions precomputed, a max-heap; no policy can beat it)

Every policy sees what the worker's expert cache sees: each MoE layer call asks at once for the
unique experts its tokens selected (in waves of at most the cache's size, as the cache splits
larger steps), all of which must be resident together (none of them may be evicted for another);
a miss always loads (no bypass). Hit rate = hits / requested unique keys per call, the expert
cache's own counters (`cache_hits`, `cache_misses`); the first use of every key is a miss for every
policy. Sizes are in experts (cache slots), as shares of all the model's experts, or in GiB with
the slot size of a pack (--pack); a RAM tier in front of the disk is sized the same way. Prints a
table, then one JSON line. Pure Python: no torch."""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from expertpack.packtools.layout import Manifest
from expertpack.packtools.units import GIB
from expertpack.planner.cache_replay import Row, pack_slot_bytes, replay
from expertpack.worker.experts.routing_trace import Trace, TraceError, read_trace

DEFAULT_FRACTIONS = (0.05, 0.10, 0.25, 0.50)
COLUMNS = {"lru": "LRU", "lfu": "LFU", "frequency": "freq", "in_use": "in use", "known_counts": "LFU*",
           "belady": "Belady"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="expertpack bench cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, metavar="TRACE", help="a routing trace (expert-worker/eval --trace)")
    p.add_argument("--slots", type=int, nargs="+", metavar="N", help="cache sizes in experts")
    p.add_argument("--share", type=float, nargs="+", metavar="F",
                   help=f"cache sizes as shares of all the model's experts (default "
                        f"{' '.join(map(str, DEFAULT_FRACTIONS))} when no size is given)")
    p.add_argument("--gib", type=float, nargs="+", metavar="G", help="cache sizes in GiB (needs --pack)")
    p.add_argument("--pack", type=Path, metavar="DIR",
                   help="the pack the trace ran on: its slot size turns sizes into GiB and back")
    p.add_argument("--label", default="", help="a note for the JSON line (machine, model)")
    return p.parse_args(argv)


def sizes_of(args: argparse.Namespace, trace: Trace, slot_bytes: int | None) -> list[int]:
    """Cache sizes in slots, each at least one layer's top-k (the worker refuses smaller caches)
    and at most every expert the model has."""
    k, total = trace.header.n_expert_used, trace.header.n_keys
    sizes = list(args.slots or [])
    for g in args.gib or []:
        if slot_bytes is None:
            raise ValueError("--gib needs --pack (the size of one cache slot)")
        sizes.append(math.floor(g * GIB / slot_bytes))
    bad = [s for s in sizes if not k <= s <= total]
    if bad:
        raise ValueError(f"cache sizes must hold one layer's top-k and at most every expert: {k}..{total} slots; "
                         f"got {bad}")
    bad = [f for f in args.share or [] if not 0 < f <= 1]
    if bad:
        raise ValueError(f"--share takes shares in (0, 1], got {bad}")
    shares = args.share or ([] if (args.slots or args.gib) else DEFAULT_FRACTIONS)
    sizes += [min(total, max(k, math.floor(f * total))) for f in shares]  # a small share: one layer's top-k
    return sorted(set(sizes))


def render(trace: Trace, rows: list[Row], path: Path) -> str:
    h = trace.header
    distinct = len({(c.layer, int(e)) for c in trace.calls for e in set(c.ids.flat)})
    lines = [f"trace {path}: {h.arch} {h.model}, {len(h.moe_layers)} MoE layers x {h.n_expert} experts, top-{h.n_expert_used}; "
             f"{trace.n_steps} steps, {trace.n_tokens} tokens, {len(trace.calls)} layer calls, {distinct} distinct "
             f"experts used" + (" (torn last line dropped)" if trace.truncated else ""),
             "hit rate = hits / unique experts requested per layer call (the expert cache's counters)", ""]
    gib = any(r.gib is not None for r in rows)
    head = f"{'slots':>7} {'share':>6}" + (f" {'GiB':>7}" if gib else "") + "".join(f" {c:>7}" for c in COLUMNS.values()) \
        + "  in use/Belady"
    lines += [head, "-" * len(head)]
    for r in rows:
        line = f"{r.slots:>7} {r.share:>6.1%}" + (f" {r.gib:>7.2f}" if gib else "")
        line += "".join(f" {r.hit_rate[p]:>7.1%}" for p in COLUMNS) + f"  {r.in_use_of_belady:>13.2f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = read_trace(args.trace)
        slot_bytes = None
        if args.pack is not None:
            manifest = Manifest.load(args.pack)
            m = manifest.model
            if (m.n_expert, tuple(m.moe_layers)) != (trace.header.n_expert, trace.header.moe_layers):
                raise ValueError(f"{args.pack} has {m.n_expert} experts in layers {list(m.moe_layers)}, the trace "
                                 f"{trace.header.n_expert} in {list(trace.header.moe_layers)}: another model")
            slot_bytes = pack_slot_bytes(manifest)
        sizes = sizes_of(args, trace, slot_bytes)
    except (TraceError, ValueError, OSError) as exc:
        print(f"expertpack bench cache: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = replay(trace, sizes, slot_bytes)
    print(render(trace, rows, args.trace))
    h = trace.header
    print(json.dumps({
        "bench": "cache", "trace": str(args.trace), "label": args.label, "arch": h.arch, "model": h.model,
        "fingerprint": h.fingerprint, "moe_layers": len(h.moe_layers), "n_expert": h.n_expert,
        "n_expert_used": h.n_expert_used, "steps": trace.n_steps, "tokens": trace.n_tokens,
        "layer_calls": len(trace.calls), "slot_bytes": slot_bytes,
        "rows": [{**asdict(r), "in_use_of_belady": round(r.in_use_of_belady, 4)} for r in rows],
        "machine": f"{platform.node()} {platform.machine()}", "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"), "replay_s": round(time.perf_counter() - start, 3)}))
    return 0


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
