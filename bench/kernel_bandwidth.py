#!/usr/bin/env python3
"""How close the decode step's weight-reading kernels come to the GPU's memory bandwidth, per shape
of one model: every distinct trunk matrix a one-token step multiplies (matvec) and one layer's
selected experts (gate+up and down over k pairs), each timed alone with triton.testing.do_bench
(L2 flushed between runs), reported as bytes of weights read per second; a regrouped Q8_0 matrix
(weights.regroup_q8_0) also in its GGUF order, through the kernel that reads that. With --sweep the
kernels' tile rows, warps and split-K programs per multiprocessor are varied, to choose them from
measurements.
  python3 bench/kernel_bandwidth.py MODEL.gguf [--sweep]
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.kernels import linear_tl, moe_tl, routing_tl
from expertpack.worker.weights.qtensor import QTensor, ungroup_q8_0
from expertpack.worker.weights.quant import Q8_0_REGROUPED


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def host_rows(x, table, offsets, w, roles, act, k_top: int, stride: int, layer: int, config) -> list[dict]:
    """The same experts read in place from pinned host memory (offsets reaching from the VRAM pool
    to the host block: the device reads host memory at its host address), copied into VRAM by DMA
    then read, and gathered into VRAM by the table step's kernel then read; the outputs must equal
    the VRAM-resident ones bit for bit."""
    host = table.cpu().pin_memory()
    dev_offsets = offsets + (host.data_ptr() - table.data_ptr())
    want = moe_tl.experts_per_pair(x, table, offsets, w, roles, act)
    got = moe_tl.experts_per_pair(x, table, dev_offsets, w, roles, act)
    torch.cuda.synchronize()
    if not torch.equal(want, got):
        raise SystemExit("experts read from host memory differ from the same bytes in VRAM")
    scratch = torch.empty(k_top * stride, dtype=torch.uint8, device=table.device)
    starts = offsets.tolist()
    local = torch.arange(k_top, device=table.device, dtype=torch.int64) * stride

    def copied() -> None:
        for i, s in enumerate(starts):
            scratch[i * stride:(i + 1) * stride].copy_(host[s:s + stride], non_blocking=True)
        moe_tl.experts_per_pair(x, scratch, local, w, roles, act)
    # As a table step reads kept RAM-tier blocks: its lookup copies them into transit slots on the
    # device (routing_tl.expert_lookup's gather kernel), then the experts run from there.
    transit = torch.empty((k_top + k_top) * stride, dtype=torch.uint8, device=table.device)
    row = dev_offsets + (table.data_ptr() - transit.data_ptr())  # the host blocks, from the transit pool
    ids = torch.arange(k_top, device=table.device)
    rec = torch.zeros(2, k_top, dtype=torch.int64, device=table.device)

    def gathered() -> None:
        at = routing_tl.expert_lookup(ids, row, rec[0], rec[1], transit, k_top * stride, stride, stride)
        moe_tl.experts_per_pair(x, transit, at, w, roles, act)
    gathered()
    torch.cuda.synchronize()
    if not torch.equal(want, moe_tl.experts_per_pair(x, transit, routing_tl.expert_lookup(
            ids, row, rec[0], rec[1], transit, k_top * stride, stride, stride), w, roles, act)):
        raise SystemExit("experts gathered from host memory differ from the same bytes in VRAM")
    bn, warps, per_sm = config
    out = []
    for label, fn in (("in place", lambda: moe_tl.experts_per_pair(x, table, dev_offsets, w, roles, act)),
                      ("copied", copied), ("gathered", gathered)):
        ms = bench_ms(fn)
        out.append({"kernel": "host " + label, "tensor": f"blk.{layer} x{k_top}", "type": roles.gate.ggml_type,
                    "shape": [roles.gate.n, roles.gate.k], "bn": bn, "warps": warps, "per_sm": per_sm,
                    "us": ms * 1e3, "gbps": k_top * stride / ms / 1e6})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF (or pack directory)")
    p.add_argument("--sweep", action="store_true", help="also try other tile rows and warps")
    p.add_argument("--host", action="store_true",
                   help="also read one layer's selected experts where they lie in pinned host memory (over PCIe, "
                        "as a RAM-tier expert is read in place), beside copying them into VRAM first")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dev = torch.device("cuda")
    engine = Engine.load(args.model, device="cuda", resident_experts=True)
    model = engine.model
    rows = []
    shapes: dict[tuple, tuple[str, object]] = {}
    for name, t in model.w.items():
        if name.startswith("blk.0.") or not name.startswith("blk."):
            if (isinstance(t, QTensor) and len(t.shape) == 2 and not name.startswith("token_embd")
                    and t.ggml_type.name not in ("F32", "I32")):  # float32 matrices are not read by matvec
                shapes.setdefault((t.kernel_type, t.shape[0], t.shape[1]), (name, t))
    defaults = (linear_tl.BN_MATVEC, linear_tl.BN_REGROUPED, linear_tl.MATVEC_WARPS, linear_tl.PROGRAMS_PER_SM)
    sweep = [(bn, w, s) for bn in (16, 32) for w in (4, 8) for s in (4, 8, 16)] if args.sweep else []
    for (qt, k, n), (name, t) in sorted(shapes.items(), key=lambda kv: kv[1][0]):
        x = torch.randn(1, k, device=dev)
        layouts = [(t.ggml_type.name + " regrouped" * t.regrouped, qt, t.raw)]
        if t.regrouped:  # beside the GGUF order it was regrouped from
            layouts.append((t.ggml_type.name, int(t.ggml_type), ungroup_q8_0(t.raw)))
        for label, kt, raw in layouts:
            first = (defaults[1] if kt == Q8_0_REGROUPED else defaults[0], defaults[2], defaults[3])
            for bn, warps, per_sm in [first] + [c for c in sweep if c != first]:
                linear_tl.BN_MATVEC = linear_tl.BN_REGROUPED = bn
                linear_tl.MATVEC_WARPS, linear_tl.PROGRAMS_PER_SM = warps, per_sm
                ms = bench_ms(lambda: linear_tl.matvec_parts(x, raw, kt, k, n))  # the consumer adds the splits
                rows.append({"kernel": "matvec", "tensor": name, "type": label, "shape": [n, k], "bn": bn,
                             "warps": warps, "per_sm": per_sm, "us": ms * 1e3, "gbps": raw.numel() / ms / 1e6})
    linear_tl.BN_MATVEC, linear_tl.BN_REGROUPED, linear_tl.MATVEC_WARPS, linear_tl.PROGRAMS_PER_SM = defaults
    moe = model.moe
    layer = min(moe._roles) if moe._roles else None
    if layer is not None:
        roles, act = moe._roles[layer], moe.act(layer)
        layout = moe.source.layout(layer)
        table = moe.source.tables[layer]
        n_expert = table.numel() // layout.stride
        k_top = getattr(model.args, "n_expert_used")
        ids = torch.randperm(n_expert, device=dev)[:k_top]
        offsets = ids * layout.stride
        x = torch.randn(1, roles.gate.k, device=dev)
        w = torch.rand(k_top, device=dev)
        econfigs = [(moe_tl.BN, moe_tl.WARPS, moe_tl.PROGRAMS_PER_SM)]
        if args.sweep:
            econfigs += [(bn, wp, s) for bn in (16, 32) for wp in (4, 8) for s in (8, 16, 32)
                         if (bn, wp, s) != econfigs[0]]
        for bn, warps, per_sm in econfigs:
            moe_tl.BN, moe_tl.WARPS, moe_tl.PROGRAMS_PER_SM = bn, warps, per_sm
            ms = bench_ms(lambda: moe_tl.experts_per_pair(x, table, offsets, w, roles, act))
            rows.append({"kernel": "experts", "tensor": f"blk.{layer} x{k_top}", "type": roles.gate.ggml_type,
                         "shape": [roles.gate.n, roles.gate.k], "bn": bn, "warps": warps, "per_sm": per_sm,
                         "us": ms * 1e3, "gbps": k_top * layout.stride / ms / 1e6})
            if args.host:
                rows += host_rows(x, table, offsets, w, roles, act, k_top, layout.stride, layer, (bn, warps, per_sm))
    print(f"{'kernel':<8} {'tensor':<28} {'type':<14} {'shape':>14} {'bn':>3} {'warps':>5} {'per SM':>6} {'us':>8} "
          f"{'GB/s':>7}")
    for r in rows:
        print(f"{r['kernel']:<8} {r['tensor']:<28} {str(r['type']):<14} {'x'.join(map(str, r['shape'])):>14} "
              f"{r['bn']:>3} {r['warps']:>5} {r['per_sm']:>6} {r['us']:>8.1f} {r['gbps']:>7.0f}")
    print(json.dumps({"bench": "kernel_bandwidth", "date": date.today().isoformat(), "model": args.model.name,
                      "gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
