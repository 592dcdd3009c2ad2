"""`expertpack eval MODEL`: run a model on a prompt, print the greedy (or sampled) continuation, and
save the float32 logits of every prompt position. Experts are read by this process, or with
--daemon come from expertd through the device cache (whose counters are then printed). How users
and tools check a model against another implementation; its flags are kept stable."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn

import numpy as np
import torch

from expertpack.client import ClientError

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.experts.cache_policy import CacheTooSmall
from expertpack.worker.experts.daemon_link import DaemonLost
from expertpack.worker.experts.routing_trace import start_trace, stop_trace
from expertpack.worker.serve.generation import sampling_temperature
from expertpack.worker.serve.main import SettingsError, pick_device, trace_problem
from expertpack.worker.serve.tokenizer import load_tokenizer


def run(args: argparse.Namespace) -> int:
    if not args.top_p > 0:
        _fail(f"--top-p must lie above 0 (the share of probability whose most likely tokens are sampled; 1 "
              f"keeps all), got {args.top_p!r}")
    if args.trace is not None and (problem := trace_problem(args.trace, args.model, args.trace_overwrite)):
        _fail(f"--trace {args.trace}: {problem}")
    try:
        args.device = pick_device(args.device)
    except SettingsError as exc:
        _fail(str(exc))
    try:
        engine = Engine.load(args.model, args.device, daemon=args.daemon, cache_bytes=args.cache_vram_mib << 20,
                             reserve_bytes=args.cache_reserve_mib << 20, name="expertpack-eval")
    except (ClientError, CacheTooSmall, ValueError) as exc:
        _fail(str(exc))
    trace = None
    try:
        if args.trace is not None:
            try:
                trace = start_trace(engine, args.trace, args.model.name)
            except OSError as exc:
                _fail(f"--trace {args.trace}: {exc.strerror or exc}")
        return _run(args, engine)
    except DaemonLost as exc:
        _fail(str(exc))
    except ClientError as exc:  # a block expertd could not read (corrupt, truncated pack), a refused session
        _fail(f"expert storage failed mid-run: {exc} (run expertpack verify on the pack expertd serves)")
    finally:
        if trace is not None:
            stop_trace(engine, trace)
        engine.close()


def _run(args: argparse.Namespace, engine: Engine) -> int:
    tokenizer = load_tokenizer(engine.files.metadata, args.tokenizer)
    if args.text is not None:
        prompt = tokenizer.encode(args.text)
    else:
        try:
            prompt = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            _fail(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    vocab = engine.model.w["token_embd.weight"].shape[1]
    bad = [t for t in prompt if not 0 <= t < vocab]
    if not prompt or bad:
        _fail(f"prompt must be non-empty token ids in 0..{vocab - 1}; bad: {bad[:5]}")
    sampler = Sampler(sampling_temperature(args.temperature, args.top_p, vocab), args.top_k, args.top_p, args.seed)
    start = time.perf_counter()
    if args.stepwise:
        tokens, logits = _stepwise(engine, prompt, args.greedy, sampler)
    else:
        tokens, logits = engine.generate(prompt, args.greedy, sampler) if args.greedy else \
            ([], engine.forward(prompt, engine.new_sequence()))
    seconds = time.perf_counter() - start
    if args.save_logits is not None:
        np.save(args.save_logits, logits.cpu().numpy().astype(np.float32))
    result = {"prompt": prompt, "continuation": tokens, "text": tokenizer.decode(tokens),
              "arch": engine.files.arch, "device": args.device, "seconds": round(seconds, 3)}
    if args.trace is not None:
        result["trace"] = str(args.trace)
    if engine.place.split:  # which layers ran where: [device, first layer, last layer] per device
        ranges = engine.layer_ranges
        result["layers"] = [[str(d), r.start, r.stop - 1] for d, r in zip(engine.place.devices, ranges)]
    if engine.expert_cache is not None:
        engine.expert_cache.link.settle()  # expertd's counters include the last cancelled prefetches
        result["expert_cache"] = engine.expert_cache.stats()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt ({len(prompt)} tokens): {','.join(map(str, prompt))}")
        print(f"continuation ({len(tokens)} tokens): {','.join(map(str, tokens))}")
        print(f"text: {result['text']!r}")
        if args.save_logits is not None:
            print(f"logits: {args.save_logits} [{logits.shape[0]}, {logits.shape[1]}] float32")
        if args.trace is not None:
            print(f"routing trace: {args.trace}")
        if engine.expert_cache is not None:
            c = result["expert_cache"]["cache"]
            print(f"expert cache: {c['slots']} slots, {c['hits']} hits, {c['misses']} misses, {c['evictions']} "
                  f"evictions, {c['h2d_bytes'] / 1e6:.1f} MB copied in, {c['stall_s']:.2f} s waiting for expertd")
        print(f"{engine.files.arch} on {args.device}, {seconds:.2f} s", file=sys.stderr)
    return 0


def _stepwise(engine: Engine, prompt: list[int], n: int, sampler: Sampler) -> tuple[list[int], torch.Tensor]:
    """Engine.generate with the prompt fed one token per forward pass: all but its last token
    here, the last one by generate on the same cache."""
    cache = engine.new_sequence()
    head = [engine.forward([t], cache) for t in prompt[:-1]]
    tokens, last = engine.generate(prompt[-1:], n, sampler, cache)
    return tokens, torch.cat([*head, last])


def _fail(message: str) -> NoReturn:
    """Bad input or an unusable environment: one line, exit 2 (as every expertpack command)."""
    print(f"expertpack eval: {message}", file=sys.stderr)
    raise SystemExit(2)
