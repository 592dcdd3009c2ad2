#!/usr/bin/env python3
"""Decode speed of the resident CUDA-graph step under kernel settings, one model load for all: each
setting assigns integer or string module constants of worker/kernels (tile rows, warps, split-K,
moe_grouped.PRECISION) or of the worker's own modules (`layers.DECODE_MAX_QUERIES`,
`moe.TILES_MIN_PAIRS_PER_EXPERT`: which path a shape takes), the step's graph is captured anew
with them, and the best of a few timed runs of 64 steps is printed with the argmax of the last run
(settings that change sums may change a late argmax; a different one says look closer). The first
setting is run again at the end, as a check of the machine's drift. Used to choose the constants
from the whole step rather than from kernels timed alone (whose launches dominate at decode
sizes). `--prefill N` times a prompt of N tokens from an empty cache instead (as llama-bench's
ppN), where the paths by shape and the launches from Python decide.
  python3 bench/decode_settings.py MODEL.gguf "moe_tl.BN=16" "moe_tl.BN=8 moe_tl.WARPS=2" ...
  python3 bench/decode_settings.py MODEL.gguf --prefill 32 "" "linear_tl.MATVEC_MAX_ROWS=32" ...
  python3 bench/decode_settings.py MODEL.gguf --prefill 512 "moe_grouped.PRECISION_WIDE=tf32x3" ""
(no setting: the defaults alone). Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from datetime import date
from pathlib import Path

import torch

from expertpack.worker.engine.engine import Engine


def module_of(name: str):
    """worker/kernels/<name>.py, else worker/<name>.py."""
    try:
        return importlib.import_module(f"expertpack.worker.kernels.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"expertpack.worker.{name}")


def parse_setting(text: str) -> dict[tuple[str, str], int | str]:
    """"moe_tl.BN=8 moe_grouped.PRECISION=bf16x3" -> {(module, name): value}, each name an existing
    integer or string constant of worker/kernels/<module>.py or worker/<module>.py."""
    out = {}
    for item in text.split():
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = module_of(module)
        current = getattr(mod, name, None)
        if isinstance(current, str) and value:
            out[(module, name)] = value
        elif isinstance(current, int) and value.lstrip("-").isdigit():
            out[(module, name)] = int(value)
        else:
            raise ValueError(f"{item!r}: want MODULE.CONSTANT=VALUE for an integer or string constant of "
                             "worker/kernels or worker")
    return out


def apply(setting: dict[tuple[str, str], int | str]) -> None:
    for (module, name), value in setting.items():
        setattr(module_of(module), name, value)


def decode_tps(engine: Engine, stream: list[int], reps: int) -> tuple[float, list[int]]:
    best, argmax = 0.0, []
    for _ in range(reps):
        with engine.new_sequence() as cache:  # the same slot each time, and the graphs captured there
            engine.forward(stream[:8], cache, last=True)
            for t in stream[8:12]:  # warm-up: compile, capture
                engine.forward([t], cache)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = [engine.forward([t], cache)[-1].argmax() for t in stream[12:76]]
            torch.cuda.synchronize()
        best = max(best, 64 / (time.perf_counter() - t0))
        argmax = [int(a) for a in out]
    return best, argmax


def prefill_tps(engine: Engine, stream: list[int], n: int, reps: int) -> tuple[float, list[int]]:
    """Best of `reps` prompts of n tokens, each from an empty cache after one warm-up of the shape;
    the argmax after the prompt."""
    engine.forward(stream[:n], engine.new_sequence(), last=True)
    best, argmax = 0.0, []
    for _ in range(reps):
        cache = engine.new_sequence()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = engine.forward(stream[:n], cache, last=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t0))
        argmax = [int(logits[-1].argmax())]
    return best, argmax


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF (or pack directory)")
    p.add_argument("settings", nargs="*", help='e.g. "moe_tl.BN=8 moe_tl.WARPS=2"')
    p.add_argument("--reps", type=int, default=3, help="timed runs of 64 steps per setting (the best counts)")
    p.add_argument("--prefill", type=int, metavar="N", help="time a prompt of N tokens instead of decode steps")
    args = p.parse_intermixed_args(argv)  # the settings may follow --prefill N
    try:
        settings = [parse_setting(s) for s in args.settings] or [{}]
    except (ValueError, ImportError) as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.prefill is not None and not 1 <= args.prefill <= 4096:
        p.error("--prefill: give 1 to 4096 tokens")
    defaults = {key: getattr(module_of(key[0]), key[1]) for s in settings for key in s}
    engine = Engine.load(args.model, device="cuda", resident_experts=True)
    stream = random.Random(0).choices(range(1000, 30000), k=max(80, args.prefill or 0))
    rows = []
    names = [text or "defaults" for text in args.settings] or ["defaults"]
    for text, setting in [*zip(names, settings), (f"{names[0]} (again)", settings[0])]:
        apply(defaults)
        apply(setting)
        engine._drop_graphs()  # the decode and prompt graphs captured anew with these constants
        if args.prefill:
            tps, argmax = prefill_tps(engine, stream, args.prefill, args.reps)
        else:
            tps, argmax = decode_tps(engine, stream, args.reps)
        rows.append({"setting": text, "tok_s": tps, "argmax": hash(tuple(argmax)) % 10**8})
        print(f"{text:60s} {tps:9.1f} tok/s  argmax {rows[-1]['argmax']}", flush=True)
    print(json.dumps({"bench": "decode_settings", "date": date.today().isoformat(), "model": args.model.name,
                      "measured": f"prefill of {args.prefill} tokens" if args.prefill else "decode, 64 steps",
                      "gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
