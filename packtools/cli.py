"""The offline verbs of `expertpack` (build, verify, inspect, synth): their flags, the ranges of their
numbers and the code that runs each. expertpack.cli puts them into the one `expertpack` command;
this module knows nothing of the worker, the client, the daemon or the benchmarks. Logs go to
stderr, results to stdout; verify exits 1 when it finds damage."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ExpertpackError
from .units import GIB, human_bytes, plain_number

if TYPE_CHECKING:
    from .synth.writer import SynthOptions

EXIT_DAMAGED = 1

# The range of every numeric flag (by its argparse dest), checked before any work: nan, inf and
# negatives are refused with one line.
RANGES: dict[str, tuple[float, float]] = {
    "safety_margin_gib": (0.0, float(1 << 30)),
    "checkpoint_every_s": (0.0, 86400.0),  # 0: after every chunk (the resume tests use it)
    "threads": (1, 1024),
    "vram_gib": (0.001, float(1 << 20)),
    "layers": (1, 1 << 16),
    "shards": (1, 9999),
    "seed": (0, (1 << 63) - 1),
    "routing_skew": (0.0, 16.0),
}


def check_ranges(args: argparse.Namespace, ranges: dict[str, tuple[float, float]]) -> None:
    """Refuses, with one line, a number outside its flag's range (by argparse dest)."""
    for dest, (low, high) in ranges.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not (math.isfinite(v) and low <= v <= high):
                raise ExpertpackError(f"--{dest.replace('_', '-')} must lie in {plain_number(low)}..{plain_number(high)}, got {v!r}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The offline verbs, each with `run` set to the function that runs it."""
    b = sub.add_parser("build", help="GGUF (one file or split set) -> experts.pack + manifest.json + trunk.gguf",
                       description="Copy every routed expert of SRC into an expert-major pack (one contiguous, "
                                   "4096-aligned block per layer and expert, bytes verbatim) and everything else "
                                   "into trunk.gguf. Streams with bounded memory; a killed build resumes when the "
                                   "same command is run again.")
    b.add_argument("src", type=Path, metavar="SRC.gguf",
                   help="a GGUF file, or the first shard (…-00001-of-000NN.gguf) of a llama.cpp split set")
    b.add_argument("-o", "--out", type=Path, help="output directory (default: SRC without .gguf, plus .expertpack)")
    b.add_argument("--force", action="store_true", help="replace a finished pack in OUT, or discard a resumable build")
    b.add_argument("--safety-margin-gib", type=float, default=1.0, metavar="G",
                   help="refuse to start unless G GiB stay free after the pack and trunk are written (default 1)")
    b.add_argument("--checkpoint-every-s", type=float, default=30.0, metavar="S",
                   help="sync and record progress every S seconds: the most work a crash can lose (default 30)")
    b.add_argument("--threads", type=int, default=None, metavar="N", help="hashing threads (default: CPU count)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    b.set_defaults(run=_build)

    v = sub.add_parser("verify", help="re-hash every expert block and check the whole pack",
                       description="Check manifest, layout contract, pack header and size, trunk fingerprint and "
                                   "tensors, and re-hash every expert block. Names each damaged (layer, expert); "
                                   "exit status 1 if anything is wrong.")
    v.add_argument("pack", type=Path, metavar="OUT", help="a pack directory written by `expertpack build`")
    v.add_argument("--threads", type=int, default=None, metavar="N", help="hashing threads (default: CPU count)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v.set_defaults(run=_verify)

    i = sub.add_parser("inspect", help="sizes for planning: bytes per expert, per token, cache fit",
                       description="Describe a pack, or a source GGUF before building it: architecture, expert "
                                   "roles and types, bytes per expert, pack and trunk sizes, routed bytes a token "
                                   "reads at 0% cache hit, and how many experts fit in a VRAM budget.")
    i.add_argument("target", type=Path, metavar="OUT|SRC.gguf",
                   help="a pack directory written by `expertpack build`, or a source GGUF (the first shard of a "
                        "split set): nothing is built")
    i.add_argument("--vram-gib", type=float, action="append", metavar="G",
                   help="VRAM budget to size the expert cache for (repeatable; default 8 16 24 32 80)")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(run=_inspect)

    s = sub.add_parser("synth", help="write a synthetic GGUF (or its pack) of a real architecture at a real model's "
                                     "shapes",
                       description="Write a GGUF with random (valid, finite) weights in the layout llama.cpp's "
                                   "converter uses for the preset's architecture, with a small trained tokenizer "
                                   "in its metadata. For benchmarks and the demo; streams at disk speed. With "
                                   "--pack instead of -o, write that GGUF's pack directly (what `expertpack build` "
                                   "makes of it, byte for byte) without the GGUF ever being on disk: for models "
                                   "whose GGUF and pack do not fit the disk together.")
    s.add_argument("--preset", help="model shape to imitate (see --list); required")
    where = s.add_mutually_exclusive_group()
    where.add_argument("-o", "--out", type=Path,
                       help="output .gguf path (a split set when --shards > 1); this or --pack is required")
    where.add_argument("--pack", type=Path, metavar="OUT",
                       help="write experts.pack, manifest.json and trunk.gguf into the directory OUT instead: "
                            "exactly what `expertpack build NAME.gguf -o OUT` writes from the GGUF `-o NAME.gguf` "
                            "would write with the same flags, its manifest naming the source NAME.gguf (OUT's name "
                            "without .expertpack, as build's default output has it). No GGUF is written; the disk "
                            "needs room for the pack and trunk only. Follows build's rules for OUT: a finished pack "
                            "is replaced only with --force, and a killed run resumes when rerun with the same flags "
                            "(it makes the model again up to its last checkpoint, for the source digest, then goes on)")
    s.add_argument("--layers", type=int, metavar="N",
                   help="keep only the first N layers (fits real shapes on a small disk; default: all of the preset's)")
    s.add_argument("--type", dest="expert_type", metavar="T", help="ggml type of the routed experts (default: preset's)")
    s.add_argument("--trunk-type", metavar="T", help="ggml type of the other matrices (default: preset's)")
    s.add_argument("--mix", dest="expert_mix", metavar="SPEC",
                   help="expert types over --type, as the low-bit dynamic GGUFs mix them: comma-separated "
                        "ROLE=T (gate, up, down) and LAYERS=T (3 or 0-2) entries, a layer's winning over a "
                        "role's, e.g. --type IQ1_S --mix down=IQ2_XXS,0=IQ3_XXS (default: none)")
    s.add_argument("--shards", type=int, default=1, metavar="N",
                   help="write a llama.cpp split set of N shards (default 1: one file)")
    s.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random weights (default 0); the same seed writes the same bytes")
    s.add_argument("--routing-skew", type=float, default=0.0, metavar="S",
                   help="Zipf-like expert popularity: in each layer the router row of the expert of (randomly "
                        "permuted) rank r is scaled by (r+1)**-S, so some experts are chosen far more often than "
                        "others (1 is strong); 0 (default) routes uniformly and writes the same bytes as before")
    s.add_argument("--force", action="store_true",
                   help="overwrite existing output files (default: refuse); with --pack, as build's --force: replace "
                        "a finished pack in OUT, or discard a resumable one")
    s.add_argument("--safety-margin-gib", type=float, default=1.0, metavar="G",
                   help="with --pack: refuse to start unless G GiB stay free after the pack and trunk are written "
                        "(default 1), as build's flag")
    s.add_argument("--list", action="store_true", help="list presets with their sizes and exit")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(run=_synth)


def _build(args: argparse.Namespace) -> int:
    from .build import BuildOptions, build_pack, default_output

    out = args.out or default_output(args.src)
    options = BuildOptions(
        force=args.force,
        safety_margin_bytes=int(args.safety_margin_gib * GIB),
        checkpoint_every_s=args.checkpoint_every_s,
        hash_threads=args.threads or BuildOptions().hash_threads,
        progress=not args.quiet,
    )
    manifest = build_pack(args.src, out, options)
    print(f"{out}  fingerprint {manifest.fingerprint}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .verify import verify_pack

    report = verify_pack(args.pack, threads=args.threads, progress=not args.quiet)
    for problem in report.problems:
        print(f"problem: {problem}")
    for d in report.damaged:
        print(f"damaged: layer {d.key.layer} expert {d.key.expert} (expected sha256 {d.expected[:16]}…, "
              f"found {d.found[:16]}…)")
    if report.ok:
        print(f"ok: {report.blocks_checked} expert blocks ({report.bytes_checked:,} B) and the trunk match "
              f"the manifest")
        return 0
    print(f"FAILED: {len(report.damaged)} damaged blocks, {len(report.problems)} other problems")
    return EXIT_DAMAGED


def _inspect(args: argparse.Namespace) -> int:
    from .inspect_pack import DEFAULT_VRAM_GIB, render_text, summarize

    report = summarize(args.target).to_dict(args.vram_gib or DEFAULT_VRAM_GIB)
    print(json.dumps(report, indent=1) if args.json else render_text(report))
    return 0


def _synth(args: argparse.Namespace) -> int:
    from .synth.presets import PRESETS
    from .synth.writer import SynthOptions, describe_presets, write_synth

    if args.list:
        print(describe_presets())
        return 0
    if not args.preset or not (args.out or args.pack):
        raise ExpertpackError("synth needs --preset NAME and either -o FILE.gguf or --pack OUT (see --list for "
                              "presets)")
    if args.preset not in PRESETS:
        raise ExpertpackError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    options = SynthOptions(
        preset=args.preset, n_layer=args.layers, expert_type=args.expert_type, trunk_type=args.trunk_type,
        expert_mix=args.expert_mix, shards=args.shards, seed=args.seed, force=args.force, progress=not args.quiet,
        routing_skew=args.routing_skew)
    if args.pack:
        return _synth_pack(args.pack, options, int(args.safety_margin_gib * GIB))
    for path in write_synth(args.out, options):
        print(path)
    return 0


def _synth_pack(out: Path, options: SynthOptions, safety_margin_bytes: int) -> int:
    """synth --pack: the build of a source made as it is read (synth/stream.py), with build's defaults."""
    from .build import BuildOptions, build_pack
    from .synth.stream import source_name, synth_source

    name = source_name(out)
    source = synth_source(options, name)
    logging.getLogger("expertpack.synth").info(
        "synth %s straight into a pack: the GGUF %s (%s) is made as the build reads it, never written",
        options.preset, name if options.shards == 1 else f"{options.shards} shards of {name}",
        human_bytes(source.size_bytes))
    manifest = build_pack(source, out, BuildOptions(force=options.force, progress=options.progress,
                                                    safety_margin_bytes=safety_margin_bytes))
    print(f"{out}  fingerprint {manifest.fingerprint}")
    return 0
