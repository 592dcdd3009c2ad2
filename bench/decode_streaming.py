#!/usr/bin/env python3
"""Decode speed with the experts streamed from the SSD through expertd into a device cache of a
fixed size, measured side by side in one run with every expert resident on the device and with the
I/O bound: the SSD bytes each decoded token needed over the disk's O_DIRECT bandwidth, as fio
measures it on the same pack (the expertd path instead when fio is not installed), the mean of a
measurement before the streaming runs and one after.

Synthesizes the preset (Qwen3-30B-A3B shapes, Q4_K experts, Q8_0 trunk by default) and packs it
unless present; starts a real expertd; runs the same prompt and decode (a) streaming with
--cache-gib of cache, with the worker's prefetch off and on (--prefetch both, the default; each
against a fresh expertd), and (b) fully resident; checks that every run produces the same argmax at
every step; prints a table (with prefetch precision and recall, and the seconds per token the
model stalled waiting for experts, and how busy the pack's disk was while each decoded: the kernel's
counters, see disk_activity.py), then one JSON line.

Decode feeds a fixed pseudo-random token stream, one token at a time through the KV cache, rather
than the model's own greedy output: a random-weight model's greedy output soon repeats one token,
whose experts are then always cached, which would flatter the cache far beyond real text.
  python3 bench/decode_streaming.py [--preset qwen3-30b-a3b] [--cache-gib 4] [--device cuda|cuda:0,cuda:1]
                                    [--prefetch both|on|off] [--dir bench-out] [--set "MODULE.CONST=V ..."]
                                    [--trace DIR]
--set changes kernel or worker constants for every run of the call (an A/B: two calls, or one of
them against the defaults); --trace writes, after each streaming run, a chrome trace of a few
decode steps, which on CUDA shows each kernel on its stream: what overlaps what in a step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import torch

from expertpack.bench.disk_activity import DiskCounters, DiskSample

REPO = Path(__file__).resolve().parents[1]
# Pinned host-to-device copies on the H200 (../.library/device/H200.md): the RAM tier's bound where
# the run cannot measure its own (no CUDA). On CUDA the bound is the rate measured in the run, the
# table step's gather of k blocks from pinned host memory: lent machines' hosts differ (one H100
# gathered at ~25 GB/s, others at 50).
PCIE_GB_PER_S = 55.0


def sync(device: str) -> None:
    """Waits for every GPU the device list names (`cuda`, or `cuda:0,cuda:1` for a split)."""
    if device.startswith("cuda"):
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def run(engine, prompt: list[int], n_decode: int, device: str, on_phase, seed: int = 0) -> dict:
    """Prefill then decode of a pseudo-random token stream drawn with `seed`, the argmax of every
    step recorded; `on_phase(name)` is called at each phase boundary (counters)."""
    # Warm-up of both shapes, a short prompt and a decode step: kernels compile on their first
    # call, and a first decode step inside the measured run had made the first of two runs look
    # slower (by 0.12 s a token on Kimi-K3's shapes, 2026-12-01).
    warm = engine.new_sequence()
    engine.forward(prompt[:4], warm)
    engine.forward(prompt[4:5], warm)
    sync(device)
    warm.close()  # its slot, and the graphs captured there, are the measured run's
    on_phase("start")
    cache = engine.new_sequence()
    t0 = time.perf_counter()
    logits = engine.forward(prompt, cache, last=True)
    sync(device)
    prefill_s = time.perf_counter() - t0
    on_phase("prefill")
    tokens = [int(logits[-1].argmax())]  # the argmax after each step: what the runs compare
    feed = random.Random(seed).choices(range(logits.shape[-1]), k=n_decode - 1)
    t0 = time.perf_counter()
    for token in feed:
        tokens.append(int(engine.forward([token], cache)[-1].argmax()))
    sync(device)
    decode_s = time.perf_counter() - t0
    on_phase("decode")
    return {"prefill_tps": len(prompt) / prefill_s, "decode_tps": (n_decode - 1) / decode_s, "tokens": tokens}


TRACED_STEPS = 4  # decode steps a --trace records, after a prompt and as many untraced ones


def trace_steps(engine, prompt: list[int], device: str, path: Path) -> None:
    """A chrome trace (chrome://tracing, ui.perfetto.dev) of TRACED_STEPS decode steps of a new
    sequence: on CUDA its kernels by stream, which shows what overlaps what inside a step's graphs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with engine.new_sequence() as cache:
        logits = engine.forward(prompt, cache, last=True)
        feed = random.Random(len(prompt)).choices(range(logits.shape[-1]), k=2 * TRACED_STEPS)
        for token in feed[:TRACED_STEPS]:  # the graphs of this slot captured before the trace
            engine.forward([token], cache)
        sync(device)
        with profile(activities=activities) as prof:
            for token in feed[TRACED_STEPS:]:
                engine.forward([token], cache)
            sync(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    print(f"trace of {TRACED_STEPS} decode steps: {path}", file=sys.stderr)


def prepare_pack(preset: str, layers: int | None, workdir: Path, routing_skew: float = 0.0,
                 expert_type: str | None = None, expert_mix: str | None = None) -> tuple[str, Path]:
    """(name, pack directory) of the synthetic preset (cut to `layers`, its routing skewed by
    `routing_skew` as `expertpack synth --routing-skew` does, its experts of `expert_type` and
    `expert_mix` as synth's --type and --mix), synthesized and packed into `workdir` unless there
    already; shared with decode_workers.py."""
    from expertpack.packtools.build import BuildOptions, build_pack
    from expertpack.packtools.synth.writer import SynthOptions, write_synth

    workdir.mkdir(parents=True, exist_ok=True)
    types = "".join(f"-{t}" for t in (expert_type, expert_mix) if t).replace("=", "_").replace(",", "_")
    stem = f"{preset}{f'-{layers}L' if layers else ''}{f'-skew{routing_skew:g}' if routing_skew else ''}{types}"
    src, pack = workdir / f"{stem}.gguf", workdir / f"{stem}.pack"
    if not (pack / "manifest.json").exists():  # written last: an interrupted build resumes
        if not src.exists():
            print(f"synthesizing {src} ...", file=sys.stderr)
            write_synth(src, SynthOptions(preset=preset, n_layer=layers, routing_skew=routing_skew,
                                          expert_type=expert_type, expert_mix=expert_mix, progress=False))
        print(f"packing {pack} ...", file=sys.stderr)
        build_pack(src, pack, BuildOptions(progress=False))
    return stem, pack


MODES = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}  # --prefetch -> the streaming runs, in order


def streaming_run(pack: Path, workdir: Path, prompt: list[int], args: argparse.Namespace, prefetch: bool) -> dict:
    """One streaming run against a fresh expertd (nothing warm from another run): its speeds and
    tokens, and per phase the cache's counters (hit rate, stall, prefetch precision and recall)
    and the SSD bytes expertd read."""
    from expertpack.bench import bench_io
    from expertpack.packtools.layout import PACK_FILE
    from expertpack.worker.engine.engine import Engine
    from expertpack.worker.experts.expert_cache import prefetch_rates

    disk = DiskCounters.open(pack / PACK_FILE)
    daemon = bench_io.DaemonProcess(pack, workdir, threads=8, splits=4, slots=64, ram_cache_gib=args.ram_cache_gib,
                                    client_slots=args.client_slots)
    try:
        t0 = time.perf_counter()
        engine = Engine.load(pack, args.device, daemon=daemon.endpoint, cache_bytes=int(args.cache_gib * 2**30),
                             name="bench-decode", prefetch=prefetch)
        sync(args.device)
        load_s = time.perf_counter() - t0
        cache = engine.expert_cache
        marks: dict[str, tuple[dict, int, dict]] = {}
        disk_marks: dict[str, DiskSample] = {}

        def mark(phase: str) -> None:
            if disk is not None:
                disk_marks[phase] = disk.sample()
            marks[phase] = (cache.counters.snapshot(), cache.link.stats()["counters"]["pack_read_bytes"],
                            cache.read_ahead())

        if args.passes > 1:  # warm as a serving worker is: every expert read once where the model fits
            cache.fill()
        for seed in range(args.passes):  # the last pass is measured; the ones before warm the tiers
            out = run(engine, prompt, args.decode, args.device, mark, seed=seed)
        if args.trace is not None:  # after the measured pass: the profiler's own cost stays out of it
            trace_steps(engine, prompt, args.device, args.trace / f"decode-prefetch-{'on' if prefetch else 'off'}.json")
        out.update(slots=cache.n_slots, slot_bytes=cache.slot_bytes, pinned=cache.link.pinned, load_s=load_s)
        engine.close()
        engine = cache = None  # the device memory goes back before the next run
    finally:
        daemon.stop()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    def phase(name: str, before: str) -> dict:
        (c1, r1, a1), (c0, r0, a0) = marks[name], marks[before]
        d = {k: c1[k] - c0[k] for k in c1}
        looked = d["hits"] + d["misses"]
        return {"hit_rate": d["hits"] / looked if looked else 0.0, "ssd_bytes": r1 - r0, "stall_s": d["stall_s"],
                "h2d_bytes": d["h2d_bytes"], "kept_hits": d["kept_hits"], "prefetch_issued": d["prefetch_issued"],
                "prefetch_used": d["prefetch_used"], "prefetch_stale": d["prefetch_stale"],
                **prefetch_rates(d), "ahead": {k: a1[k] - a0[k] for k in a1}}

    out.update(prefill=phase("prefill", "start"), decode=phase("decode", "prefill"))
    out["disk"] = None if disk is None else DiskCounters.between(disk_marks["prefill"], disk_marks["decode"])
    return out


def disk_bandwidth(pack: Path, workdir: Path) -> tuple[float, str]:
    """GB/s of O_DIRECT random whole-expert reads on this pack: fio, else expertd."""
    from expertpack.bench import bench_io
    from expertpack.packtools.layout import ExpertKey, Manifest

    m = Manifest.load(pack)
    total = min(4 * 2**30, m.pack_size_bytes - m.data_start)
    try:
        piece = -(-m.max_stride // 4 // 4096) * 4096  # as expertd splits a block (--read-splits 4)
        r = bench_io.run_fio(pack, m, piece=piece, splits=4, jobs=8, total=total)
        return r.gb_per_s, "fio O_DIRECT, 8 jobs"
    except SystemExit:
        keys = [ExpertKey(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]
        keys = random.Random(0).sample(keys, min(len(keys), total // m.max_stride))
        r = bench_io.run_daemon(pack, m, keys, [keys[:m.model.n_expert_used]], 8, 4, workdir)
        return r.gb_per_s, "expertd (fio not installed)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--type", metavar="T", help="ggml type of the routed experts (synth's --type; default: the preset's)")
    p.add_argument("--mix", metavar="SPEC", help="per-role / per-layer expert types over --type (synth's --mix)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--cache-gib", type=float, default=4.0)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded one at a time")
    p.add_argument("--ram-cache-gib", type=float, default=0.0,
                   help="expertd's RAM tier (default 0: every miss of the VRAM cache read from the SSD)")
    p.add_argument("--client-slots", type=int, default=16, metavar="N",
                   help="expertd's client_slots, the staging slots the worker leases (default 16, expertd's own: "
                        "what a served worker gets; of 64 in all)")
    p.add_argument("--routing-skew", type=float, default=0.0, metavar="S",
                   help="synthesize with `expertpack synth --routing-skew S` (Zipf-like expert popularity; "
                        "default 0: uniform routing, where any cache's hit rate is its share of the experts)")
    p.add_argument("--lookahead", type=int, metavar="N",
                   help="MoE layers ahead of the running one whose experts the worker asks for (default: the "
                        "worker's, worker/experts/lookahead.py's LOOKAHEAD_LAYERS)")
    p.add_argument("--skip-resident", action="store_true", help="when the model does not fit on the device")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="prefill and decode N times on one expertd and worker, each pass another token stream, "
                        "and report the last: with N > 1 the RAM tier and the VRAM cache are warm, as a serving "
                        "worker's are, its cache filled first as expert-worker does (default 1: cold)")
    p.add_argument("--prefetch", choices=sorted(MODES), default="both",
                   help="stream with the worker's prefetch off, on, or both side by side (default)")
    p.add_argument("--set", default="", metavar='"MODULE.CONST=VALUE ..."',
                   help="integer or string constants of worker/kernels or worker modules for every run, as "
                        'decode_settings.py takes them (e.g. "routing_tl.GATHER_PROGRAMS=32")')
    p.add_argument("--trace", type=Path, metavar="DIR",
                   help=f"after each streaming run, a chrome trace of {TRACED_STEPS} decode steps into "
                        "DIR/decode-prefetch-MODE.json (on CUDA: kernels by stream)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_settings import apply, parse_setting

    try:
        settings = parse_setting(args.set)
    except (ValueError, ModuleNotFoundError) as exc:
        p.error(f"--set: {exc}")

    from expertpack.packtools.layout import Manifest
    from expertpack.worker.experts import lookahead
    from expertpack.worker.engine.engine import Engine

    if args.lookahead is not None:
        lookahead.LOOKAHEAD_LAYERS = args.lookahead
    stem, pack = prepare_pack(args.preset, args.layers, args.dir, args.routing_skew, args.type, args.mix)
    m = Manifest.load(pack)
    expert_bytes = sum(l.payload_bytes * m.model.n_expert for l in m.layers)
    workdir = Path(tempfile.mkdtemp(prefix="decode-streaming-"))
    before, bandwidth_how = disk_bandwidth(pack, workdir)
    prompt = list(range(100, 100 + args.prompt))

    pcie_gb_s, pcie_how = PCIE_GB_PER_S, "nominal: H200.md's pinned copies"
    if args.device.startswith("cuda"):  # before --set: the machine's rate, not a setting's
        from expertpack.bench.host_bandwidth import gather_gb_s
        first = torch.device(args.device.split(",")[0])
        pcie_gb_s = gather_gb_s(first, m.model.n_expert_used, max(layout.payload_bytes for layout in m.layers))
        pcie_how = f"measured: the table step's gather from pinned host memory to {first}"
    apply(settings)
    runs = {mode: streaming_run(pack, workdir, prompt, args, mode == "on") for mode in MODES[args.prefetch]}
    # The lent H200's virtual disk reads faster after a rest than under sustained reads (before the
    # runs 1.44-1.95 GB/s, after them 1.31-1.72, 2026-12-02): the bound takes the mean of the two.
    after, _ = disk_bandwidth(pack, workdir)
    bandwidth = (before + after) / 2
    n_slots, slot_bytes, pinned, load_s = (runs[MODES[args.prefetch][0]][k] for k in ("slots", "slot_bytes", "pinned", "load_s"))
    decode_tokens = args.decode - 1
    for run_ in runs.values():
        run_["ssd_per_token"] = run_["decode"]["ssd_bytes"] / decode_tokens
        run_["io_bound_tps"] = bandwidth * 1e9 / run_["ssd_per_token"] if run_["ssd_per_token"] else float("inf")
    first = runs[MODES[args.prefetch][0]]

    resident = None
    if not args.skip_resident:
        engine = Engine.load(pack, args.device, resident_experts=True)
        resident = run(engine, prompt, args.decode, args.device, lambda phase: None, seed=args.passes - 1)
        del engine
    reference = resident["tokens"] if resident is not None else first["tokens"]
    same = all(r["tokens"] == reference for r in runs.values())
    digest = hashlib.sha256(json.dumps(first["tokens"]).encode()).hexdigest()[:16]
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"

    print(f"model     {stem} ({expert_bytes / 1e9:.2f} GB of experts, {m.model.n_expert} x {len(m.layers)} layers, "
          f"top-{m.model.n_expert_used}) on {args.device} ({gpu})")
    print(f"cache     {args.cache_gib:g} GiB = {n_slots} slots of {slot_bytes / 2**20:.2f} MiB "
          f"({n_slots * slot_bytes / expert_bytes:.0%} of the experts), staging pinned: {pinned}; load {load_s:.1f} s; "
          f"expertd client_slots {args.client_slots}")
    if args.set:
        print(f"settings  {args.set}")
    print(f"disk      {bandwidth:.2f} GB/s ({bandwidth_how}; {before:.2f} before the streaming runs, {after:.2f} after); "
          f"prefetch {lookahead.LOOKAHEAD_LAYERS} MoE layers ahead")
    print(f"{'':26}{'prefill tok/s':>14}{'decode tok/s':>14}{'hit rate':>10}{'SSD MB/token':>14}{'stall s/token':>15}"
          f"{'precision':>11}{'recall':>8}")
    for mode, r in runs.items():
        dec = r["decode"]
        print(f"{'streaming, prefetch ' + mode:26}{r['prefill_tps']:14.2f}{r['decode_tps']:14.2f}"
              f"{dec['hit_rate']:10.1%}{r['ssd_per_token'] / 1e6:14.1f}{dec['stall_s'] / decode_tokens:15.3f}"
              f"{dec['prefetch_precision']:11.1%}{dec['prefetch_recall']:8.1%}")
    if resident:
        print(f"{'every expert resident':26}{resident['prefill_tps']:14.2f}{resident['decode_tps']:14.2f}")
    for mode, r in runs.items():
        print(f"{'I/O bound (disk / SSD B per token), prefetch ' + mode:52}{r['io_bound_tps']:14.2f}"
              + (f"   decode at {r['decode_tps'] / r['io_bound_tps']:.2f}x of it" if r["ssd_per_token"] else ""))
    for mode, r in runs.items():
        dec = r["decode"]
        pcie = (dec["h2d_bytes"] + dec["kept_hits"] * slot_bytes) / decode_tokens  # copies in, kept blocks read
        if pcie:
            bound = pcie_gb_s * 1e9 / pcie
            ceiling = min(bound, resident["decode_tps"]) if resident else bound
            r["pcie_bound_tps"] = bound
            print(f"PCIe bound ({pcie_gb_s:.2f} GB/s, {pcie_how} / {pcie / 1e6:.1f} MB per token, "
                  f"{dec['kept_hits'] / decode_tokens:.1f} kept blocks a token), prefetch {mode}: {bound:.2f} tok/s; "
                  f"decode at {r['decode_tps'] / ceiling:.2f}x of min(it, resident)")
    for mode, r in runs.items():
        ahead = r["decode"]["ahead"]
        if ahead["copied_ahead"] and ahead["kept_pairs"]:  # table steps copied guessed kept blocks ahead (TableDecode)
            print(f"copied ahead, prefetch {mode}: {ahead['read_ahead'] / ahead['kept_pairs']:.1%} of the guessed layers' "
                  f"{ahead['kept_pairs'] / decode_tokens:.1f} kept pairs a token read ahead; "
                  f"{ahead['copied_ahead'] / decode_tokens:.1f} blocks copied ahead a token "
                  f"(~{(ahead['copied_ahead'] - ahead['read_ahead']) * slot_bytes / decode_tokens / 1e6:.1f} MB of wrong guesses)")
    for mode, r in runs.items():
        if r["disk"] is not None:
            print(f"decode, prefetch {mode:4} {r['disk'].describe()}")
    print(f"argmax at every step identical across {', '.join(f'prefetch {m}' for m in runs)}"
          f"{' and the resident run' if resident else ''}: {same} (sha256 {digest})")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({
        "bench": "decode_streaming", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu", "gpu": gpu, "device": args.device,
        "torch": torch.__version__, "model": f"synth {args.preset}" + (f" --layers {args.layers}" if args.layers else "")
        + (f" --type {args.type}" if args.type else "") + (f" --mix {args.mix}" if args.mix else "")
        + (f" --routing-skew {args.routing_skew:g}" if args.routing_skew else ""),
        "expert_bytes": expert_bytes, "cache_bytes": n_slots * slot_bytes, "slots": n_slots, "staging_pinned": pinned,
        "settings": args.set, "ram_cache_gib": args.ram_cache_gib, "passes": args.passes, "client_slots": args.client_slots, "lookahead_layers": lookahead.LOOKAHEAD_LAYERS,
        "disk_gb_per_s": round(bandwidth, 3), "disk_gb_per_s_before": round(before, 3), "disk_gb_per_s_after": round(after, 3),
        "disk_measured_by": bandwidth_how, "pcie_gb_per_s": round(pcie_gb_s, 3), "pcie_measured_by": pcie_how,
        "streaming": {f"prefetch_{mode}": {"prefill_tokens_per_s": round(r["prefill_tps"], 3),
                                           "decode_tokens_per_s": round(r["decode_tps"], 3), "prefill": r["prefill"],
                                           "decode": r["decode"], "stall_s_per_token": r["decode"]["stall_s"] / decode_tokens,
                                           "io_bound_decode_tokens_per_s": round(r["io_bound_tps"], 3),
                                           "ssd_bytes_per_decoded_token": r["ssd_per_token"],
                                           "pcie_bound_decode_tokens_per_s": r.get("pcie_bound_tps"),
                                           "disk_during_decode": None if r["disk"] is None else asdict(r["disk"])}
                      for mode, r in runs.items()},
        "resident": None if resident is None else {"prefill_tokens_per_s": round(resident["prefill_tps"], 3),
                                                   "decode_tokens_per_s": round(resident["decode_tps"], 3)},
        "argmax_identical": same, "argmax_sha256": digest,
    }))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
