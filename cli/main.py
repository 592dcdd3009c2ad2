"""`expertpack VERB`: the offline tools (build, verify, inspect, synth, from packtools), `eval` (the
worker), `plan` (the worker's cache sized for a machine) and `bench io|serve|cache` (the benchmarks)
behind one parser. Each verb's code loads only when it runs: the worker's (and torch) for eval, the
benchmark's for bench, so the offline tools start in milliseconds. Exit status: 0 success, 1 verify
found damage, 2 bad input or environment (one-line message), 130 interrupted (a build resumes when
rerun)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from expertpack.packtools import cli as offline
from expertpack.packtools.errors import ExpertpackError
from . import eval_args

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# bench KIND -> the module under expertpack.bench that runs it with the remaining arguments.
BENCHES = {"io": "bench_io", "serve": "bench_serve", "cache": "bench_cache"}
RANGES = {**offline.RANGES, **eval_args.RANGES}  # both give --seed the same range


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # its own parser, --help included (argparse's REMAINDER will not take a first option)
        return _plan(argparse.Namespace(rest=argv[1:]))
    args = parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
                        format="expertpack: %(message)s")
    try:
        offline.check_ranges(args, RANGES)
        return args.run(args)
    except ExpertpackError as exc:
        from expertpack.packtools.build import BuildInterrupted

        print(f"expertpack {args.command}: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED if isinstance(exc, BuildInterrupted) else EXIT_USAGE
    except OSError as exc:  # a path that cannot be created, read or written: the user's to fix
        print(f"expertpack {args.command}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"expertpack {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="expertpack",
        description="Offline tools for expert packs: turn a Mixture-of-Experts GGUF into an expert-major "
                    "pack that expertd streams from the SSD, check it, size it, or make a synthetic model.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    offline.add_commands(sub)

    e = sub.add_parser("eval", help="run a model in this process: continuation and prompt logits",
                       description="Run MODEL (a pack or a source GGUF) in this process, reading its experts itself "
                                   "(or, with --daemon, from expertd): print the greedy (or sampled) continuation of "
                                   "the prompt and save the float32 logits of every prompt position. For checking a "
                                   "model against another implementation.")
    eval_args.add_arguments(e)  # the flags only: importing them does not import torch
    e.set_defaults(run=_eval)

    bench = sub.add_parser("bench", help="benchmarks that print a table and a JSON line",
                           description="io: expertd against fio and the buffered path on one pack "
                                       "(`expertpack bench io --help`); serve: the reference serving protocol "
                                       "against an OpenAI-compatible endpoint (`expertpack bench serve --help`); "
                                       "cache: a routing trace replayed against LRU, LFU, the worker's policy and "
                                       "Belady's optimum (`expertpack bench cache --help`).")
    bench.add_argument("kind", choices=tuple(BENCHES))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(run=_bench)
    plan = sub.add_parser("plan", help="size the expert cache for a machine and predict decode tok/s and its bound",
                          description="`expertpack plan --help` for its own arguments.", add_help=False)
    plan.add_argument("rest", nargs=argparse.REMAINDER, help="plan's own arguments")
    plan.set_defaults(run=_plan)
    return p


def _eval(args: argparse.Namespace) -> int:
    from . import eval as eval_cli  # the worker and torch load only for this verb

    return eval_cli.run(args)


def _plan(args: argparse.Namespace) -> int:
    from expertpack.planner import plan

    return plan.main(args.rest)


def _bench(args: argparse.Namespace) -> int:
    return importlib.import_module(f"expertpack.bench.{BENCHES[args.kind]}").main(args.rest)

