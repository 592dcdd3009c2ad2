"""`expertpack plan PACK`: how a pack would run on a machine, before running it. It sizes the worker's
VRAM expert cache from the GPU memory left after the trunk (less its token embedding, which the worker
reads from host memory) and a reserve, and expertd's RAM tier
behind it; predicts their hit rates (a routing trace, or uniform routing simulated, replayed
through the worker's cache policy and the daemon's RAM tier policy); and from the bytes a token
then reads predicts decode tok/s and which bound holds: the disk (expert blocks the RAM tier
missed, read whole with O_DIRECT), PCIe (the payloads the VRAM cache missed, copied to the GPU) or
compute (the resident decode step, when given, plus the worker's host time for each miss: its
fetch, copies and bookkeeping between two segments of the step, which the GPU waits for). Two
figures: a worker that fetches a layer's misses after its router ran and waits for them (compute
+ host + the slower of disk and PCIe); with prefetch overlapping the reads (the streaming issue's
goal), the slowest of the three. Where the VRAM cache and the RAM-tier blocks expertd lets one
worker keep (protocol v8, at expertd's defaults) hold every expert, the worker reads each once at
start and its steps then find every expert without expertd: the RAM tier hits every miss, there is
no host time per miss, and the GPU's copies of the kept experts (PCIe) come before each layer's
compute (today: compute + PCIe). It can write the `worker.toml` and `expertd.toml` for that split.

Prefill of a --prompt-tokens P prompt, as one chunk: each MoE layer loads the distinct experts its P
tokens select once (under uniform routing n (1 - (1 - k/n)^P) of its n), found in the tiers at the
decode hit rates; its compute is the resident prefill of that prompt (--prefill-tok-s, measured at
the same P), and the same two figures, today's and overlapped, follow.

--layers N projects a truncated pack (`expertpack synth --preset NAME --layers 4`, at the real
model's shapes) onto the whole model of N layers: the expert bytes per token and the experts to
cache grow with the MoE layers, the trunk by its MoE layers' tensors, the compute time by the bytes
a decode step reads (the trunk less its embedding table, and the top-k experts), and a trace's
hit rates are replayed at each tier's share of the experts. Every input is printed with where it
came from, so the arithmetic can be checked by hand.

  expertpack plan PACK [--vram-gib G] [--ram-gib R] [--disk-gbps B] [--pcie-gbps P] [--compute-tok-s C]
                       [--miss-host-ms MS] [--prompt-tokens P] [--prefill-tok-s C] [--layers N] [--trace FILE] [--write DIR] [--json]"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from expertpack.daemon.config import DaemonConfig
from expertpack.daemon.ram_tier import ram_slot_count
from expertpack.daemon.staging import lockable_bytes
from expertpack.packtools.cli import check_ranges
from expertpack.packtools.errors import ExpertpackError
from expertpack.packtools.gguf_source import open_source
from expertpack.packtools.layout import PACK_FILE, Manifest
from expertpack.packtools.units import GIB, human_bytes

from .cache_replay import pack_slot_bytes, requests_of, tiered_hit_rates, uniform_requests
from expertpack.worker.experts.routing_trace import TraceError, read_trace

DEFAULT_RESERVE_GIB = 1.5  # VRAM kept for the KV cache, activations and CUDA's own (the worker's cache_reserve)
DEFAULT_PCIE_GBPS = 25.0  # a PCIe 4.0 x16 link's practical pinned copy rate; PCIe 5.0 about twice
# The worker's time per miss of its VRAM cache beyond the resident step, with decode steps as
# segmented CUDA graphs: bench/profile_streaming.py on the H200 machine (2026-12-01, BENCHMARKS.md),
# every miss a RAM-tier hit, (15.26 ms a token - 1.61 ms resident) / 75.5 misses. It includes the
# copy each miss waits for, which the PCIe term counts again: predictions err low by that much.
DEFAULT_MISS_HOST_MS = 0.18
DISK_PROBE_S = 2.0
UNIFORM_LAYERS = 8  # layers simulated for uniform routing's hit rates, each tier at its share of the experts
UNIFORM_TURNOVER = 40  # keys requested per slot of both tiers, at least
UNIFORM_MIN_TOKENS = 500
UNIFORM_MAX_KEYS = 2_000_000  # about 10 s of replay
DEFAULT_PROMPT_TOKENS = 256  # a chat prompt of the reference protocol's size (bench serve: 240-290 tokens)
MIB = 1 << 20

# The range of every numeric flag (by argparse dest), checked with one line before anything is
# measured: speeds and the VRAM are positive, the reserve and the RAM tier may be 0.
RANGES: dict[str, tuple[float, float]] = {
    "vram_gib": (0.001, 1e6),
    "reserve_gib": (0.0, 1e6),
    "ram_gib": (0.0, 1e6),
    "disk_gbps": (0.001, 1e6),
    "pcie_gbps": (0.001, 1e6),
    "compute_tok_s": (0.001, 1e6),
    "miss_host_ms": (0.0, 1000.0),
    "prefill_tok_s": (0.001, 1e6),
    "prompt_tokens": (1, 1 << 20),
    "layers": (1, 1 << 16),
}


class PlanError(ExpertpackError):
    """An input the plan cannot use; the message says which flag gives it."""


@dataclass(frozen=True)
class Inputs:
    pack: str
    n_moe_layers: int
    n_expert: int
    n_expert_used: int
    block_bytes_per_token: int  # at 0% hit: top-k blocks (strides) of every MoE layer
    payload_bytes_per_token: int
    slot_bytes: int  # one cache slot, as the worker's ExpertCache sizes them
    trunk_bytes: int  # what the trunk holds in VRAM: all of it but its token embedding (Placement.weights)
    vram_bytes: int
    reserve_bytes: int
    ram_bytes: int  # expertd's RAM tier
    ram_slot_bytes: int  # one RAM tier slot: expertd's staging slot, the largest expert block
    pack_moe_layers: int  # the pack's own; differs from n_moe_layers when projected (--layers)
    disk_gbps: float
    pcie_gbps: float
    compute_tok_s: float | None
    miss_host_s: float  # the worker's host time per VRAM cache miss
    prompt_tokens: int
    prefill_tok_s: float | None  # resident prefill of a prompt_tokens prompt (projected with --layers)
    sources: dict[str, str]  # input -> where it came from (flag, measured, ...)


@dataclass(frozen=True)
class Plan:
    cache_bytes: int
    slots: int
    share_of_experts: float
    ram_slots: int
    ram_share_of_experts: float
    hit_rate: float  # of the keys requested, in the VRAM cache
    ram_hit_rate: float  # of the VRAM cache's misses, in the RAM tier
    hit_rate_from: str
    keep_slots: int  # RAM-tier blocks the worker keeps (expertd's defaults, less a sixteenth for its fetches)
    kept_all: bool  # the VRAM slots and the kept blocks hold every expert: no host work per miss
    disk_bytes_per_token: float
    pcie_bytes_per_token: float
    disk_s: float
    pcie_s: float
    compute_s: float | None
    host_s: float  # the worker's host time for a token's misses
    tok_s_today: float | None  # None: nothing bounds it (every expert cached and no compute given)
    tok_s_overlapped: float | None
    bound: str
    prefill_experts_per_layer: float  # distinct experts a prompt selects in one MoE layer
    prefill_disk_bytes: float
    prefill_pcie_bytes: float
    prefill_disk_s: float
    prefill_pcie_s: float
    prefill_compute_s: float | None
    prefill_host_s: float
    prefill_tok_s_today: float | None
    prefill_tok_s_overlapped: float | None
    prefill_bound: str


def measure_disk_gbps(pack: Path, seconds: float = DISK_PROBE_S, threads: int = 8) -> float:
    """Random whole expert blocks read with O_DIRECT by `threads` readers for `seconds` (the page
    cache bypassed, as expertd reads): bytes per second / 1e9."""
    m = Manifest.load(pack)
    blocks = [(l.offset + e * l.stride, l.stride) for l in m.layers for e in range(m.model.n_expert)]
    path = pack / PACK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        raise PlanError(f"{path}: O_DIRECT open failed ({exc.strerror}); give the disk's speed with --disk-gbps")
    deadline = time.monotonic() + seconds

    def reader(seed: int) -> int:
        rng = random.Random(seed)
        buf = mmap.mmap(-1, max(size for _, size in blocks))  # page-aligned, as O_DIRECT wants
        done = 0
        try:
            while time.monotonic() < deadline:
                offset, size = rng.choice(blocks)
                done += os.preadv(fd, [memoryview(buf)[:size]], offset)
        finally:
            buf.close()
        return done

    start = time.monotonic()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(reader, range(threads)))
    except OSError as exc:
        raise PlanError(f"{path}: O_DIRECT read failed ({exc.strerror}); give the disk's speed with --disk-gbps")
    finally:
        os.close(fd)
    return total / (time.monotonic() - start) / 1e9


def inputs_of(args: argparse.Namespace) -> Inputs:
    m = Manifest.load(args.pack)
    sources = {}
    if args.vram_gib is not None:
        vram, sources["vram"] = int(args.vram_gib * GIB), "--vram-gib"
    else:
        vram, sources["vram"] = _gpu_memory(), "the GPU (torch.cuda)"
    if args.disk_gbps is not None:
        disk, sources["disk"] = args.disk_gbps, "--disk-gbps"
    else:
        print(f"measuring the disk: O_DIRECT reads of whole expert blocks for {DISK_PROBE_S:.0f} s ...", file=sys.stderr)
        disk, sources["disk"] = measure_disk_gbps(args.pack), f"measured ({DISK_PROBE_S:.0f} s of O_DIRECT block reads)"
    sources["pcie"] = "--pcie-gbps" if args.pcie_gbps is not None else f"default (PCIe 4.0 x16, {DEFAULT_PCIE_GBPS} GB/s)"
    k, moe = m.model.n_expert_used, len(m.layers)
    blocks, payload = sum(k * l.stride for l in m.layers), sum(k * l.payload_bytes for l in m.layers)
    trunk, compute, prefill = m.trunk.size_bytes, args.compute_tok_s, args.prefill_tok_s
    embedding, moe_trunk = _trunk_parts(args.pack / m.trunk.file, m)
    sources["compute"] = "--compute-tok-s" if compute else "not given"
    sources["host"] = ("--miss-host-ms" if args.miss_host_ms is not None
                       else "measured on the H200 machine with segmented graphs (BENCHMARKS.md, profile_streaming)")
    sources["prefill"] = "--prefill-tok-s" if prefill else "not given"
    n_moe = moe
    if args.layers is not None and args.layers != m.model.n_layer:
        dense = m.model.n_layer - moe  # the leading dense layers, which a truncation keeps
        if args.layers <= dense:
            raise PlanError(f"--layers {args.layers}: the model's first {dense} layers are dense; give more")
        n_moe = args.layers - dense
        read_before = trunk - embedding + payload  # what a decode step reads: one embedding row only
        blocks, payload = blocks * n_moe // moe, payload * n_moe // moe
        trunk += moe_trunk * n_moe // moe - moe_trunk
        if compute:  # decode is bound by the bytes it reads
            read_after = trunk - embedding + payload
            compute *= read_before / read_after
            sources["compute"] = (f"--compute-tok-s x {read_before / 1e9:.3f} / {read_after / 1e9:.3f} GB a decode "
                                  "step reads (the trunk less its embedding table, and the top-k experts)")
        if prefill:  # a prompt's compute grows with the layers that run it
            prefill *= m.model.n_layer / args.layers
            sources["prefill"] = f"--prefill-tok-s x {m.model.n_layer} / {args.layers} layers"
        sources["layers"] = (f"--layers {args.layers}: the pack's {moe} MoE layers' figures x {n_moe}/{moe}, the "
                             "trunk's MoE-layer tensors too")
    ram_slot_bytes = m.max_stride
    n_blocks = n_moe * m.model.n_expert
    if args.ram_gib is not None:
        ram, sources["ram"] = int(args.ram_gib * GIB), "--ram-gib"
    else:
        staging = max(64, 2 * k) * ram_slot_bytes  # what expertd.toml gets (write_configs)
        slots, why = ram_slot_count(None, ram_slot_bytes, staging, lockable_bytes()[0], n_blocks)
        ram, sources["ram"] = slots * ram_slot_bytes, f"as expertd would size it on this host: {why}"
    # the worker keeps the token embedding in pinned host memory and reads a step's rows in place
    return Inputs(str(args.pack), n_moe, m.model.n_expert, k, blocks, payload, pack_slot_bytes(m), trunk - embedding,
                  vram, int(args.reserve_gib * GIB), ram, ram_slot_bytes, moe, disk, args.pcie_gbps or DEFAULT_PCIE_GBPS,
                  compute, (DEFAULT_MISS_HOST_MS if args.miss_host_ms is None else args.miss_host_ms) / 1e3,
                  args.prompt_tokens, prefill, sources)


def _trunk_parts(trunk_file: Path, m: Manifest) -> tuple[int, int]:
    """The trunk's embedding table (token_embd: a decode step reads one row of it) and its MoE
    layers' tensors (blk.N.* of a MoE layer), in bytes."""
    embedding = moe = 0
    for t in open_source(trunk_file).tensors:
        parts = t.name.split(".")
        if t.name.startswith("token_embd."):
            embedding += t.nbytes
        elif parts[0] == "blk" and int(parts[1]) in m.model.moe_layers:
            moe += t.nbytes
    return embedding, moe


def _gpu_memory() -> int:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise PlanError("no CUDA GPU here to read its memory from; give it with --vram-gib")
    return torch.cuda.get_device_properties(0).total_memory


def plan(inputs: Inputs, trace: Path | None = None) -> Plan:
    cache = inputs.vram_bytes - inputs.trunk_bytes - inputs.reserve_bytes
    n_total = inputs.n_moe_layers * inputs.n_expert
    slots = min(n_total, max(0, cache) // inputs.slot_bytes)
    if slots < inputs.n_expert_used:
        raise PlanError(f"{human_bytes(inputs.vram_bytes)} of VRAM leaves {human_bytes(max(cache, 0))} for the expert "
                        f"cache after the trunk on the GPU ({human_bytes(inputs.trunk_bytes)}) and the reserve "
                        f"({human_bytes(inputs.reserve_bytes)}): it must hold one layer's top-{inputs.n_expert_used} "
                        f"({human_bytes(inputs.n_expert_used * inputs.slot_bytes)})")
    ram_slots = min(n_total, inputs.ram_bytes // inputs.ram_slot_bytes)
    if trace is not None:
        hit, ram_hit = _trace_hit_rates(trace, inputs, slots, ram_slots)
        source = f"{trace} replayed through the worker's cache policy and expertd's RAM tier policy"
        if inputs.n_moe_layers != inputs.pack_moe_layers:
            source += f", each at the same share of its {inputs.pack_moe_layers} layers' experts"
    else:
        hit, ram_hit, source = _uniform_hit_rates(inputs, slots, ram_slots)
    keep_slots = _keep_slots(ram_slots)
    kept_all = slots + keep_slots >= n_total
    miss_host_s = inputs.miss_host_s
    if kept_all:  # read once at start (ExpertCache.fill), then found in VRAM or kept in the tier
        ram_hit, miss_host_s = 1.0, 0.0
        source += "; every expert kept in VRAM or the RAM tier after the worker's first read of each"
    miss = 1.0 - hit
    disk_bytes = miss * (1.0 - ram_hit) * inputs.block_bytes_per_token
    pcie_bytes = miss * inputs.payload_bytes_per_token  # a RAM hit is copied to the GPU too
    disk_s, pcie_s = disk_bytes / (inputs.disk_gbps * 1e9), pcie_bytes / (inputs.pcie_gbps * 1e9)
    compute_s = 1.0 / inputs.compute_tok_s if inputs.compute_tok_s else None
    host_s = miss * inputs.n_expert_used * inputs.n_moe_layers * miss_host_s
    today, overlapped, bound = _figures(disk_s, pcie_s, compute_s, host_s, 1, "--compute-tok-s")
    # Prefill: each layer's distinct experts of the prompt, loaded once, found at the decode hit rates.
    n, k, tokens = inputs.n_expert, inputs.n_expert_used, inputs.prompt_tokens
    distinct = n * (1.0 - (1.0 - k / n) ** tokens)
    pre_disk = distinct / k * miss * (1.0 - ram_hit) * inputs.block_bytes_per_token
    pre_pcie = distinct / k * miss * inputs.payload_bytes_per_token
    pre_disk_s, pre_pcie_s = pre_disk / (inputs.disk_gbps * 1e9), pre_pcie / (inputs.pcie_gbps * 1e9)
    pre_compute_s = tokens / inputs.prefill_tok_s if inputs.prefill_tok_s else None
    pre_host_s = distinct * miss * inputs.n_moe_layers * miss_host_s
    pre_today, pre_overlapped, pre_bound = _figures(pre_disk_s, pre_pcie_s, pre_compute_s, pre_host_s, tokens,
                                                    "--prefill-tok-s")
    return Plan(slots * inputs.slot_bytes, slots, slots / n_total, ram_slots, ram_slots / n_total, hit, ram_hit,
                source, keep_slots, kept_all, disk_bytes, pcie_bytes, disk_s, pcie_s, compute_s, host_s, today, overlapped, bound,
                distinct, pre_disk, pre_pcie, pre_disk_s, pre_pcie_s, pre_compute_s, pre_host_s, pre_today,
                pre_overlapped, pre_bound)


def _keep_slots(ram_slots: int) -> int:
    """The RAM-tier blocks one worker keeps under expertd's defaults: its keep share (the tier less
    its hold share) less the sixteenth its cache leaves free for its fetches (ExpertCache._keep_target)."""
    config = DaemonConfig()
    keeps = config.ram_keep_share(ram_slots, config.ram_hold_share(config.client_slots, ram_slots))
    return keeps - max(1, keeps // 16) if keeps else 0


def _figures(disk_s: float, pcie_s: float, compute_s: float | None, host_s: float, tokens: int, flag: str
             ) -> tuple[float | None, float | None, str]:
    """Tokens/s of `tokens` taking those seconds: today's (compute and the host's work per miss, then
    the slower of disk and PCIe: misses wait) and overlapped (the slowest; reads overlap compute,
    not the host's work between the step's segments, which the GPU waits for), and the bound
    (the worker's term, compute and host together, is named after the larger part; None: nothing
    bounds it)."""
    worker = (compute_s or 0.0) + host_s
    terms = {"disk": disk_s, "pcie": pcie_s}
    if worker:
        terms["compute" if (compute_s or 0.0) >= host_s else "host"] = worker
    today = worker + max(disk_s, pcie_s)
    overlapped = max(terms.values())
    bound = max(terms, key=terms.get) if overlapped else f"none: every expert is cached; give {flag}"
    return (tokens / today if today else None, tokens / overlapped if overlapped else None, bound)


def _trace_hit_rates(path: Path, inputs: Inputs, slots: int, ram_slots: int) -> tuple[float, float]:
    """The trace's VRAM and RAM hit rates; a projection (--layers) replays the trace's own layers
    with each tier at the share of the experts it has in the whole model."""
    try:
        trace = read_trace(path)
    except (OSError, TraceError) as exc:
        raise PlanError(f"{path}: {exc}")
    if trace.header.n_expert != inputs.n_expert:
        raise PlanError(f"{path}: a trace of a model with {trace.header.n_expert} experts per layer, this pack has "
                        f"{inputs.n_expert}")
    scale = len(trace.header.moe_layers) / inputs.n_moe_layers
    return tiered_hit_rates(requests_of(trace), max(inputs.n_expert_used, round(slots * scale)),
                            round(ram_slots * scale))


def _uniform_hit_rates(inputs: Inputs, slots: int, ram_slots: int) -> tuple[float, float, str]:
    """Uniform routing through both tiers' policies. The VRAM cache then hits its share of the
    experts, whatever its policy; the RAM tier, which sees only the VRAM cache's misses, is not
    independent of it (its blocks are often the very experts the VRAM cache holds), so it is
    simulated: UNIFORM_LAYERS layers, each tier at its share, long enough that every slot turns
    over many times, counted after the first half (the warm-up)."""
    layers = min(inputs.n_moe_layers, UNIFORM_LAYERS)
    scale = layers / inputs.n_moe_layers
    v, r = max(inputs.n_expert_used, round(slots * scale)), round(ram_slots * scale)
    tokens = min(UNIFORM_MAX_KEYS // (layers * inputs.n_expert_used),
                 max(UNIFORM_MIN_TOKENS, -(-UNIFORM_TURNOVER * (v + r) // (layers * inputs.n_expert_used))))
    requests = uniform_requests(layers, inputs.n_expert, inputs.n_expert_used, tokens)
    hit, ram_hit = tiered_hit_rates(requests, v, r, warmup=len(requests) // 2)
    return hit, ram_hit, (f"uniform routing simulated through both tiers' policies: {tokens} tokens x {layers} layers, "
                          f"{v} VRAM and {r} RAM slots, the second half counted")


def write_configs(directory: Path, inputs: Inputs, p: Plan) -> list[Path]:
    """worker.toml (the cache size planned, its reserve) and expertd.toml (the pack; staging for two
    layers' top-k, at least 64 slots; the RAM tier planned) beside each other."""
    directory.mkdir(parents=True, exist_ok=True)
    pack = Path(inputs.pack).resolve()
    worker = directory / "worker.toml"
    worker.write_text(f'# written by `expertpack plan`: {p.slots} cache slots, predicted hit rate {p.hit_rate:.1%}\n'
                      f'pack = "{pack}"\ncache_vram_mib = {-(-p.cache_bytes // MIB)}\n'
                      f'cache_reserve_mib = {inputs.reserve_bytes // MIB}\n')
    daemon = directory / "expertd.toml"
    daemon.write_text(f'# written by `expertpack plan`: {p.ram_slots} RAM tier slots, predicted hit rate '
                      f'{p.ram_hit_rate:.1%} of the worker\'s misses\npack = "{pack}"\n'
                      f'stage_slots = {max(64, 2 * inputs.n_expert_used)}\n'
                      f'ram_cache_gib = {p.ram_slots * inputs.ram_slot_bytes / GIB:.3f}\n')
    return [worker, daemon]


def render(inputs: Inputs, p: Plan) -> str:
    s = inputs.sources
    rows = [
        ("pack", inputs.pack, ""),
        ("MoE layers x experts, top-k", f"{inputs.n_moe_layers} x {inputs.n_expert}, top-{inputs.n_expert_used}",
         s.get("layers", "")),
        ("GPU memory", human_bytes(inputs.vram_bytes), s["vram"]),
        ("- trunk, - reserve", f"{human_bytes(inputs.trunk_bytes)}, {human_bytes(inputs.reserve_bytes)}",
         "the trunk less its token embedding (read from host memory); --reserve-gib"),
        ("expert cache", f"{human_bytes(p.cache_bytes)}: {p.slots} slots of {human_bytes(inputs.slot_bytes)}, "
                         f"{p.share_of_experts:.1%} of the experts", ""),
        ("RAM tier (expertd)", f"{human_bytes(p.ram_slots * inputs.ram_slot_bytes)}: {p.ram_slots} blocks of "
                               f"{human_bytes(inputs.ram_slot_bytes)}, {p.ram_share_of_experts:.1%} of the experts", s["ram"]),
        ("hit rate", f"VRAM {p.hit_rate:.1%} of the experts asked for, RAM {p.ram_hit_rate:.1%} of the rest",
         p.hit_rate_from),
        ("disk", f"{inputs.disk_gbps:.2f} GB/s", s["disk"]),
        ("PCIe", f"{inputs.pcie_gbps:.1f} GB/s", s["pcie"]),
        ("compute (resident decode)", f"{inputs.compute_tok_s} tok/s" if inputs.compute_tok_s else "-", s["compute"]),
        ("kept RAM-tier experts", f"{p.keep_slots} blocks: " + (
            "with the VRAM cache, every expert (read once at start; no host work per miss)" if p.kept_all else
            f"with the VRAM cache {p.slots + p.keep_slots} of {inputs.n_moe_layers * inputs.n_expert} experts: "
            "misses wait for expertd"), "expertd's defaults (client_ram_keeps, protocol v8)"),
        ("worker host per miss", f"{0 if p.kept_all else inputs.miss_host_s * 1e3:.3g} ms: {p.host_s * 1e3:.1f} ms a "
                                 "token", "no miss asks expertd" if p.kept_all else s["host"]),
        ("read per token", f"{human_bytes(p.disk_bytes_per_token)} of blocks ({p.disk_s * 1e3:.1f} ms), "
                           f"{human_bytes(p.pcie_bytes_per_token)} copied ({p.pcie_s * 1e3:.1f} ms)", ""),
        ("decode today", _rate(p.tok_s_today), "compute + PCIe: each layer's kept experts copied in, then computed"
         if p.kept_all else "compute + host + max(disk, PCIe): misses wait"),
        ("decode, I/O overlapped", _rate(p.tok_s_overlapped), f"bound: {p.bound}"),
        ("prefill, read", f"{inputs.prompt_tokens} tokens: {p.prefill_experts_per_layer:.1f} experts a layer, "
                          f"{human_bytes(p.prefill_disk_bytes)} of blocks ({p.prefill_disk_s * 1e3:.1f} ms), "
                          f"{human_bytes(p.prefill_pcie_bytes)} copied ({p.prefill_pcie_s * 1e3:.1f} ms)",
         "--prompt-tokens; uniform routing, the decode hit rates"),
        ("compute (resident prefill)", f"{inputs.prefill_tok_s:.6g} tok/s" if inputs.prefill_tok_s else "-",
         s["prefill"]),
        ("prefill today", _rate(p.prefill_tok_s_today), "compute + host + max(disk, PCIe)"),
        ("prefill, I/O overlapped", _rate(p.prefill_tok_s_overlapped), f"bound: {p.prefill_bound}"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" + (f"  ({src})" if src else "") for name, value, src in rows)


def _rate(tok_s: float | None) -> str:
    return f"{tok_s:.2f} tok/s" if tok_s is not None else "-"


DESCRIPTION = """\
Before you run a pack on a machine: how large the worker's expert cache in GPU memory and
expertd's RAM tier can be there, how often they will hold the experts a token needs, and the
decode and prefill speed that follows, with what limits it: the disk, the PCIe link, or compute.

Give the machine's GPU memory (read from its GPU when there is one) and, to get speeds rather than
limits, how fast the model runs on that GPU with every expert in memory (--compute-tok-s). The
disk is measured on the pack unless --disk-gbps says. Hit rates come from uniform routing, or from
prompts you recorded with `expert-worker --trace FILE` (--trace: closer to real use). Every input
is printed with where it came from, so the arithmetic can be checked by hand."""

EXAMPLES = """\
examples:
  expertpack plan model.pack --vram-gib 24 --compute-tok-s 60
  expertpack plan model.pack --trace chats.jsonl --write /etc/expertpack   # and write the two configs
  expertpack plan cut.pack --layers 48 --vram-gib 80    # cut.pack: `expertpack synth --layers 4` of a
                                                        # 48-layer model, predicted for all 48"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertpack plan", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pack", type=Path, help="a pack directory written by `expertpack build`")
    p.add_argument("--vram-gib", type=float, metavar="G",
                   help="the GPU's memory in GiB (default: read from the first CUDA GPU; needed without one)")
    p.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB, metavar="G",
                   help=f"GPU memory kept for the KV cache and activations, out of the expert cache (default "
                        f"{DEFAULT_RESERVE_GIB})")
    p.add_argument("--ram-gib", type=float, metavar="G",
                   help="expertd's RAM tier in GiB (default: what expertd would take on this machine: half the "
                        "available memory, at most the pack)")
    p.add_argument("--disk-gbps", type=float, metavar="B",
                   help="the disk's read speed in GB/s (default: measured on the pack for 2 s, as expertd reads)")
    p.add_argument("--pcie-gbps", type=float, metavar="B",
                   help=f"host-to-GPU copy speed in GB/s (default {DEFAULT_PCIE_GBPS}, PCIe 4.0 x16)")
    p.add_argument("--compute-tok-s", type=float, metavar="C",
                   help="decode tokens/s of this model on this GPU with every expert in GPU memory (default: not "
                        "known, so only the I/O limits are predicted)")
    p.add_argument("--miss-host-ms", type=float, metavar="MS",
                   help=f"the worker's CPU time for each expert its GPU cache misses (default {DEFAULT_MISS_HOST_MS}, "
                        "measured on an H200 machine)")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, metavar="P",
                   help=f"the length of the prompt whose prefill is predicted, in tokens (default "
                        f"{DEFAULT_PROMPT_TOKENS})")
    p.add_argument("--prefill-tok-s", type=float, metavar="C",
                   help="prefill tokens/s of a --prompt-tokens prompt on this GPU with every expert in GPU memory "
                        "(default: not known; as --compute-tok-s)")
    p.add_argument("--layers", type=int, metavar="N",
                   help="the pack holds the first layers of a larger model (`expertpack synth --layers`): predict "
                        "for the whole model of N layers (default: the pack as it is)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="a routing trace recorded by `expert-worker --trace FILE`, for hit rates from real prompts "
                        "(default: uniform routing, simulated)")
    p.add_argument("--write", type=Path, metavar="DIR",
                   help="also write the matching worker.toml and expertd.toml into DIR")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuses, with one line, a number outside its range and flags that do not go together."""
    check_ranges(args, RANGES)
    if args.layers is not None and args.write is not None:
        raise PlanError("--write writes the settings of the pack given, not of a model projected with --layers")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        inputs = inputs_of(args)
        result = plan(inputs, args.trace)
    except (ExpertpackError, OSError) as exc:
        print(f"expertpack plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"inputs": asdict(inputs), "plan": asdict(result)}))
    else:
        print(render(inputs, result))
    if args.write:
        for path in write_configs(args.write, inputs, result):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
