"""`expertpack bench cache TRACE`: replays a routing trace (`expert-worker --trace`, `expertpack eval
--trace`) against cache policies at several sizes and prints their hit rates side by side:

  LRU      evict the least recently selected expert
  LFU      evict the expert selected least often while resident (its count starts over when it
           comes back), the least recent among equals
  in use   the worker's own CachePolicy (worker/cache_policy.py), driven as the expert cache drives it
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
import heapq
import json
import math
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from expertpack.packtools.layout import ALIGNMENT, ExpertKey, Manifest
# The worker's policy and trace format are pure bookkeeping (no torch): the bench replays the
# worker's own code, not a copy of it.
from expertpack.worker.cache_policy import CachePolicy
from expertpack.worker.routing_trace import Trace, TraceError, read_trace, unique_experts

DEFAULT_FRACTIONS = (0.05, 0.10, 0.25, 0.50)
GIB = 1 << 30

Requests = Sequence[Sequence[ExpertKey]]  # per layer call, the unique keys it needs at once


def requests_of(trace: Trace) -> list[list[ExpertKey]]:
    return [[ExpertKey(layer, e) for e in experts] for layer, experts in unique_experts(trace.calls)]


def waves(requests: Requests, n_slots: int) -> list[list[ExpertKey]]:
    """A call needing more experts than the cache holds is loaded in waves of n_slots, as
    ExpertCache.expert_rows does; each wave is one request."""
    out = []
    for keys in requests:
        for start in range(0, len(keys), n_slots):
            out.append(list(keys[start:start + n_slots]))
    return out


# ---- online policies: access(keys) -> hits, the keys made resident together ---------------------
class LRU:
    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.resident: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first

    def access(self, keys: Sequence[ExpertKey]) -> int:
        hits = 0
        for k in keys:
            if k in self.resident:
                hits += 1
                self.resident.move_to_end(k)
        need = len(self.resident) + len(keys) - hits - self.n_slots
        for _ in range(need):  # the least recent are never this request's: those were just moved last
            self.resident.popitem(last=False)
        for k in keys:
            self.resident[k] = None  # a miss enters as the most recent
        return hits


class LFU:
    """Counts live only while resident (classic LFU); ties go to the least recently used."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.count: dict[ExpertKey, int] = {}
        self.last: dict[ExpertKey, int] = {}
        self.heap: list[tuple[int, int, ExpertKey]] = []  # (count, last use, key); stale entries skipped
        self.clock = 0

    def access(self, keys: Sequence[ExpertKey]) -> int:
        self.clock += 1
        hits = sum(k in self.count for k in keys)
        need = len(self.count) + len(keys) - hits - self.n_slots
        wanted = set(keys)
        while need > 0:
            c, t, k = heapq.heappop(self.heap)
            if self.count.get(k) != c or self.last[k] != t or k in wanted:
                continue  # stale, or this request's (whose entry is renewed below)
            del self.count[k], self.last[k]
            need -= 1
        for k in keys:
            self.count[k] = self._count(k)
            self.last[k] = self.clock
            heapq.heappush(self.heap, (self.count[k], self.clock, k))
        if len(self.heap) > 4 * len(self.count) + 64:  # drop stale entries now and then
            self.heap = [(self.count[k], self.last[k], k) for k in self.count]
            heapq.heapify(self.heap)
        return hits

    def _count(self, k: ExpertKey) -> int:
        return self.count.get(k, 0) + 1


class KnownCounts(LFU):
    """LFU told every expert's count over the whole trace up front (so not an online policy): it
    keeps the most popular experts. Where selections are independent draws from fixed popularities
    (as in a synthetic model, whose tokens are independent), keeping the most popular is the best
    any online policy can do, so this column bounds what a better online policy could gain."""

    def __init__(self, n_slots: int, totals: dict[ExpertKey, int]) -> None:
        super().__init__(n_slots)
        self.totals = totals

    def _count(self, k: ExpertKey) -> int:
        return self.totals[k]


def known_counts_hits(requests: Requests, n_slots: int) -> int:
    totals: dict[ExpertKey, int] = {}
    for keys in requests:
        for k in keys:
            totals[k] = totals.get(k, 0) + 1
    return online_hits(lambda n: KnownCounts(n, totals), requests, n_slots)


class InUse:
    """worker/cache_policy.CachePolicy driven exactly as ExpertCache._acquire drives it: touch every
    key of the request, then victims for the misses (this request's keys protected), then place."""

    def __init__(self, n_slots: int, policy: Callable[[int], CachePolicy] = CachePolicy) -> None:
        self.policy = policy(n_slots)

    def access(self, keys: Sequence[ExpertKey]) -> int:
        keys = list(keys)
        self.policy.touch(keys)
        misses = [k for k in keys if k not in self.policy.slot_of]
        if misses:
            for slot, key in zip(self.policy.victims(len(misses), set(keys)), misses):
                self.policy.place(slot, key)
        return len(keys) - len(misses)


def online_hits(make: Callable[[int], object], requests: Requests, n_slots: int) -> int:
    cache = make(n_slots)
    return sum(cache.access(keys) for keys in waves(requests, n_slots))


# ---- the offline optimum --------------------------------------------------------------------------
def belady_hits(requests: Requests, n_slots: int) -> int:
    """Belady's MIN for requests of several keys that must be resident together: on a miss with
    the cache full, evict the resident key (not of this request) whose next request lies
    furthest ahead, never-again first. O(total keys x log) with precomputed next uses."""
    reqs = waves(requests, n_slots)
    never = len(reqs)  # beyond every request
    next_use: list[list[int]] = [[]] * len(reqs)
    upcoming: dict[ExpertKey, int] = {}
    for t in range(len(reqs) - 1, -1, -1):
        next_use[t] = [upcoming.get(k, never) for k in reqs[t]]
        for k in reqs[t]:
            upcoming[k] = t
    resident: dict[ExpertKey, int] = {}  # key -> its next request
    heap: list[tuple[int, ExpertKey]] = []  # (-next request, key); entries whose next moved on are stale
    hits = 0
    for t, keys in enumerate(reqs):
        # This request's resident keys have next request t, every other resident one later: the
        # max-heap reaches them last, and there are always enough others (n_slots >= len(keys)).
        n_hit = sum(k in resident for k in keys)
        hits += n_hit
        for _ in range(len(resident) + len(keys) - n_hit - n_slots):
            while True:
                neg, k = heapq.heappop(heap)
                if resident.get(k) == -neg:
                    break
            assert -neg > t, "Belady would evict a key of the current request"
            del resident[k]
        for k, nxt in zip(keys, next_use[t]):
            resident[k] = nxt
            heapq.heappush(heap, (-nxt, k))
    return hits


POLICIES: dict[str, Callable[[Requests, int], int]] = {
    "lru": lambda r, n: online_hits(LRU, r, n),
    "lfu": lambda r, n: online_hits(LFU, r, n),
    "in_use": lambda r, n: online_hits(InUse, r, n),
    "known_counts": known_counts_hits,
    "belady": belady_hits,
}
COLUMNS = {"lru": "LRU", "lfu": "LFU", "in_use": "in use", "known_counts": "LFU*", "belady": "Belady"}


@dataclass
class Row:
    slots: int
    share: float  # of all the model's experts
    gib: float | None  # with a pack's slot size
    requests: int  # unique keys asked for, over all waves
    hit_rate: dict[str, float]

    @property
    def in_use_of_belady(self) -> float:
        best = self.hit_rate["belady"]
        return self.hit_rate["in_use"] / best if best else 1.0


def replay(trace: Trace, sizes: Sequence[int], slot_bytes: int | None = None,
           policies: Sequence[str] = tuple(POLICIES)) -> list[Row]:
    requests = requests_of(trace)
    rows = []
    for n in sizes:
        n_requests = sum(len(w) for w in waves(requests, n))
        rates = {p: POLICIES[p](requests, n) / n_requests if n_requests else 0.0 for p in policies}
        rows.append(Row(n, n / trace.header.n_keys, n * slot_bytes / GIB if slot_bytes else None, n_requests, rates))
    return rows


def pack_slot_bytes(manifest: Manifest) -> int:
    """One cache slot: the largest expert block rounded up to the alignment, as the worker's
    ExpertCache sizes them (worker/expert_cache.slot_bytes, which needs torch)."""
    return -(-max(l.payload_bytes for l in manifest.layers) // ALIGNMENT) * ALIGNMENT


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
