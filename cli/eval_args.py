"""The flags of `expertpack eval`, apart from the code that runs it so that building the `expertpack`
parser never imports torch. Keep them stable: tools script against them."""

from __future__ import annotations

import argparse
from pathlib import Path

# The range of each numeric flag (by argparse dest), checked with one line before the model loads.
RANGES: dict[str, tuple[float, float]] = {
    "greedy": (0, 1 << 24),
    "temperature": (0.0, 100.0),
    "top_k": (0, 1 << 31),
    "top_p": (0.0, 1.0),
    "seed": (0, (1 << 63) - 1),
    "cache_vram_mib": (0, 1 << 24),
    "cache_reserve_mib": (0, 1 << 24),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, metavar="MODEL", help="a pack directory or a source GGUF (first shard)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", metavar="IDS", help="prompt token ids, comma separated: 1,2,3 (this or --text)")
    what.add_argument("--text", help="prompt text, tokenized with the model's tokenizer (this or --tokens)")
    p.add_argument("--greedy", type=int, default=0, metavar="N",
                   help="generate N tokens after the prompt (default 0: the prompt's logits only)")
    p.add_argument("--save-logits", type=Path, metavar="F.npy",
                   help="save the float32 [n_prompt, n_vocab] prompt logits there (default: not saved)")
    p.add_argument("--stepwise", action="store_true",
                   help="run the prompt one token per forward pass, as decoding runs, instead of in one pass "
                        "(a routing trace of a given text as decode sees it; logits agree within rounding)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="record the experts every token (prompt and continuation) selects in every MoE layer: a "
                        "routing trace for `expertpack bench cache` (JSON lines; worker/experts/routing_trace.py); "
                        "an existing FILE is refused unless --trace-overwrite")
    p.add_argument("--trace-overwrite", action="store_true",
                   help="let --trace replace an existing FILE (never one of MODEL's own files)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu), or a list of GPUs "
                                                   "(cuda:0,cuda:1) over which the layers are split")
    p.add_argument("--tokenizer", type=Path, metavar="DIR",
                   help="an HF tokenizer directory overriding the GGUF's (default: the GGUF's own)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy, the likeliest token each step; so is any below 1e-5)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K likeliest tokens only (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the likeliest tokens that together hold probability P (default 1: all)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the sampler (default 0); the same seed samples the same tokens")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument("--daemon", metavar="ENDPOINT",
                   help="take the experts from expertd at ENDPOINT (e.g. ipc:///run/expertpack/expertd.sock) "
                        "through a device cache, instead of reading the pack in this process; MODEL must be the "
                        "pack the daemon serves")
    p.add_argument("--cache-vram-mib", type=int, default=4096, metavar="N",
                   help="with --daemon: the expert cache's size (default 4096); it must hold one layer's top-k")
    p.add_argument("--cache-reserve-mib", type=int, default=1024, metavar="N",
                   help="with --daemon on a GPU: device memory left free for activations (default 1024)")
