#!/usr/bin/env python3
"""Registers per thread, spills and layout conversions of the worker's hot Triton kernels, compiled
for a GPU architecture without one: Triton lowers each kernel to PTX on the CPU and the ptxas it
ships reports what the code costs. Registers bound how many programs a multiprocessor holds (65,536
per SM: a 4-warp program of 211 registers leaves room for two), and those in flight are what hides
memory latency in the decode step's short kernels; `convert_layout`s in the TTGIR are shuffles
through shared memory. With --sass, the instructions of each kernel's main loop (the longest
backward branch in nvdisasm's listing) per weight value a thread decodes, and the opcodes that
take most of them. That count is not the speed: Q4_K decode kernels with half the instructions a
value (masks, selects and int-to-float conversions gone) ran slower on the H100 once their weights
came from HBM (BENCHMARKS.md), their loops waiting on memory. Compare variants here, time them there.
  python3 bench/kernel_registers.py [--arch 90] [--types Q4_K,Q8_0,Q6_K,MXFP4] [--sass]
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from datetime import date

import triton
from gguf import GGMLQuantizationType
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from expertpack.worker.kernels import linear_tl, moe_dense, moe_grouped, moe_tiles, moe_tl
from expertpack.worker.kernels.dequant_tl import CHUNK

POINTERS = {"x_ptr": "*fp32", "pool_ptr": "*u8", "off_ptr": "*i64", "pair_ptr": "*i32", "gu_ptr": "*fp32",
            "w_ptr": "*u8", "y_ptr": "*fp32", "tok_ptr": "*i32", "block_ptr": "*i64", "table_ptr": "*i32",
            "order_ptr": "*i32", "wt_ptr": "*fp32", "out_ptr": "*fp32", "base_ptr": "*i64", "n_ptr": "*i64",
            "tiles_ptr": "*i32", "av_ptr": "*fp32"}
# Triton's launcher specializes a kernel on every argument that is a multiple of 16 (a pointer's
# address, an integer's value): torch's tensors are, and so are a real model's shapes, row bytes
# and role offsets. Compiled without that, a kernel's loads and stores of consecutive values came
# out one value each (moe_integer's rows kernel: 2-byte loads of its activations), and its
# instructions a value counted high.
ALIGNED_INTS = {"D", "F", "K", "N", "N1", "row_bytes", "gate_rb", "up_rb", "down_rb", "gate_off", "up_off",
                "down_off", "role_off", "role2_off", "out_width", "w_stride", "expert_stride", "gate_b", "up_b",
                "down_b"}
FLOATS = {"limit", "alpha", "beta", "linear_beta"}  # the activations' parameters


# Where a kernel's argument of a common name points at other data: moe_dense's products read the
# experts dequantized to float32, not their GGUF bytes.
POINTERS_OF = {moe_dense._grouped_gate_up_kernel: {"w_ptr": "*fp32"}, moe_dense._grouped_down_kernel: {"w_ptr": "*fp32"}}


def loop_opcodes(listing: str) -> collections.Counter:
    """The opcodes of the longest loop in nvdisasm's listing: the instructions between a label and
    the last backward branch to it."""
    at: dict[str, int] = {}
    lines: list[tuple[int, str, str]] = []
    waiting: list[str] = []
    for line in listing.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            waiting.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if ins:
            addr = int(ins.group(1), 16)
            at.update((name, addr) for name in waiting)
            waiting = []
            lines.append((addr, ins.group(2).split(".")[0], ins.group(3)))
    best: list[str] = []
    for addr, op, rest in lines:
        target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if target and at.get(target.group(1), addr) < addr:
            body = [o for a, o, _ in lines if at[target.group(1)] <= a <= addr]
            best = body if len(body) > len(best) else best
    return collections.Counter(best)


def compile_report(fn, constexprs: dict, warps: int, arch: int, values: int | None = None) -> dict:
    """ptxas's registers and spill bytes, and the TTGIR's layout conversions, of one specialization;
    with `values` (weight values a program decodes per iteration of its main loop), that loop's
    SASS instructions per value a thread decodes and its commonest opcodes."""
    names = list(fn.arg_names)
    pointers = {**POINTERS, **POINTERS_OF.get(fn, {})}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in FLOATS else "i32")
                 for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if n not in constexprs and (signature[n].startswith("*") or n in ALIGNED_INTS)}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True).stderr
        listing = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True, check=True).stdout if values else ""
    regs = next(int(w) for line in info.splitlines() if "registers" in line
                for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("registers"))
    spills = sum(int(w) for line in info.splitlines() if "spill" in line
                 for w, nxt in zip(line.split(), line.split()[1:]) if nxt == "bytes" and "spill" in line)
    report = {"registers": regs, "spill_bytes": spills, "layout_conversions": compiled.asm["ttgir"].count("convert_layout"),
              "programs_per_sm": 65536 // (regs * 32 * warps)}
    if values:
        ops = loop_opcodes(listing)
        report["loop_per_value"] = round(sum(ops.values()) * 32 * warps / values, 2)
        report["loop_top"] = dict(ops.most_common(5))
    return report


def kernels(qt: int) -> list[tuple[str, object, dict, int, int | None]]:
    """(name, kernel, constexprs, warps, weight values a program decodes per iteration of its main
    loop, where it decodes weights) as the worker launches them for weights of type qt."""
    act = {"ACT": 0, "GU_BIAS": False, "DOWN_BIAS": False}
    g = moe_grouped
    extra = [
        (f"grouped {name} (prompt, {bm}x{bn} tiles)", kernel,
         {"BM": bm, "BN": bn, "BK": g.BK, "PRECISION": precision, "OPERAND": triton.language.bfloat16, **more},
         g.WARPS, None)
        for bm, bn, precision in ((g.BM, g.BN, g.PRECISION), (g.BM_WIDE, g.BN_WIDE, g.PRECISION_WIDE))
        for name, kernel, more in (("gate/up", g._matrix_kernel, {}), ("down", g._down_kernel, act))
    ] if qt == moe_grouped.MXFP4 else []  # the prompt's on-chip products decode MXFP4 only
    if qt == int(GGMLQuantizationType.Q8_0):  # trunk matrices of 256-value multiples, as placed on the GPU
        extra.append(("matvec regrouped (trunk)", linear_tl._matvec_q8_0r_kernel, {"BN": linear_tl.BN_REGROUPED},
                      linear_tl.MATVEC_WARPS, linear_tl.BN_REGROUPED * CHUNK))
    if qt == int(GGMLQuantizationType.Q4_K):  # Q4_K experts without biases: tiles of their own (moe_tiles)
        extra += [("Q4_K tiles gate+up (prompt)", moe_tiles._gate_up_q4_k_kernel, {"G": moe_tiles.G_Q4_K, "BN": moe_tiles.BN},
                   moe_tiles.WARPS, 2 * moe_tiles.BN * CHUNK),
                  ("Q4_K tiles down (prompt)", moe_tiles._down_q4_k_kernel, {"G": moe_tiles.G_Q4_K, "BN": moe_tiles.BN},
                   moe_tiles.WARPS, moe_tiles.BN * CHUNK)]
    return [
        ("matvec (trunk)", linear_tl._matvec_kernel, {"QT": qt, "BN": linear_tl.BN_MATVEC, "CH": CHUNK},
         linear_tl.MATVEC_WARPS, linear_tl.BN_MATVEC * CHUNK),
        ("experts gate+up (decode)", moe_tl._gate_up_kernel,
         {"QG": qt, "QU": qt, "HAS_PAIRS": False, "BN": moe_tl.BN, "CH": CHUNK}, moe_tl.WARPS, 2 * moe_tl.BN * CHUNK),
        ("experts down (decode)", moe_tl._down_kernel,
         {"QD": qt, "SPLITS": 2, "HAS_PAIRS": False, "BN": moe_tl.BN, "CH": CHUNK, **act}, moe_tl.WARPS,
         moe_tl.BN * CHUNK),
        ("tiles gate+up (prompt)", moe_tiles._gate_up_kernel,
         {"QG": qt, "QU": qt, "G": moe_tiles.G, "BN": moe_tiles.BN, "CH": CHUNK}, moe_tiles.WARPS,
         2 * moe_tiles.BN * CHUNK),
        ("tiles down (prompt)", moe_tiles._down_kernel,
         {"QD": qt, "G": moe_tiles.G, "BN": moe_tiles.BN, "CH": CHUNK, **act}, moe_tiles.WARPS, moe_tiles.BN * CHUNK),
        ("dequantize experts (dense)", moe_dense._dequant_blocks_kernel,
         {"QT": qt, "BN": moe_dense.BN_DEQUANT, "CH": CHUNK}, 4, None),
        *((f"dense {name} (prompt, float32)", kernel,
           {"BM": moe_dense.BM, "BN": moe_dense.BN, "BK": moe_dense.BK, "PRECISION": moe_dense.PRECISION, **more},
           moe_dense.WARPS, None)  # the dequantized experts' products, the same for every type
          for name, kernel, more in (("gate/up", moe_dense._grouped_gate_up_kernel, {}),
                                     ("down", moe_dense._grouped_down_kernel, act))),
    ] + extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90 (H100, H200)")
    p.add_argument("--types", default="Q4_K,Q8_0", help="ggml types of the weights, comma-separated")
    p.add_argument("--sass", action="store_true",
                   help="also the decode kernels' main-loop instructions per weight value a thread decodes")
    args = p.parse_args(argv)
    try:
        types = [GGMLQuantizationType[t] for t in args.types.split(",")]
    except KeyError as e:
        p.error(f"unknown ggml type {e}")
    rows = []
    for qt in types:
        for name, fn, consts, warps, values in kernels(int(qt)):
            rows.append({"kernel": name, "type": qt.name, "warps": warps,
                         **compile_report(fn, consts, warps, args.arch, values if args.sass else None)})
    print(f"{'kernel':<28} {'type':<6} {'warps':>5} {'registers':>9} {'spill B':>7} {'programs/SM':>11} {'conversions':>11}"
          + ("  loop instructions a value (commonest)" if args.sass else ""))
    for r in rows:
        loop = f"  {r['loop_per_value']:>6.2f} {r['loop_top']}" if "loop_per_value" in r else ""
        print(f"{r['kernel']:<28} {r['type']:<6} {r['warps']:>5} {r['registers']:>9} {r['spill_bytes']:>7} "
              f"{r['programs_per_sm']:>11} {r['layout_conversions']:>11}{loop}")
    print(json.dumps({"bench": "kernel_registers", "date": date.today().isoformat(), "arch": args.arch,
                      "triton": triton.__version__, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
