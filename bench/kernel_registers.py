#!/usr/bin/env python3
"""Registers per thread, spills and layout conversions of the worker's hot Triton kernels, compiled
for a GPU architecture without one: Triton lowers each kernel to PTX on the CPU and the ptxas it
ships reports what the code costs. Registers bound how many programs a multiprocessor holds (65,536
per SM: a 4-warp program of 211 registers leaves room for two), and those in flight are what hides
memory latency in the decode step's short kernels; `convert_layout`s in the TTGIR are shuffles
through shared memory. Use it to compare kernel variants here, then time the winner on the device.
  python3 bench/kernel_registers.py [--arch 90] [--types Q4_K,Q8_0,Q6_K,MXFP4]
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import json
import os
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
            "tiles_ptr": "*i32"}
# Arguments every launch gives as multiples of 16, which Triton's launcher specializes on (the
# regrouped matvec's 128-bit loads need them; other kernels are compiled without, as before).
ALIGNED = {linear_tl._matvec_q8_0r_kernel: ("x_ptr", "w_ptr", "y_ptr", "K", "row_bytes")}


# Where a kernel's argument of a common name points at other data: moe_dense's products read the
# experts dequantized to float32, not their GGUF bytes.
POINTERS_OF = {moe_dense._grouped_gate_up_kernel: {"w_ptr": "*fp32"}, moe_dense._grouped_down_kernel: {"w_ptr": "*fp32"}}


def compile_report(fn, constexprs: dict, warps: int, arch: int) -> dict:
    """ptxas's registers and spill bytes, and the TTGIR's layout conversions, of one specialization."""
    names = list(fn.arg_names)
    pointers = {**POINTERS, **POINTERS_OF.get(fn, {})}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED.get(fn, ())}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True).stderr
    regs = next(int(w) for line in info.splitlines() if "registers" in line
                for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("registers"))
    spills = sum(int(w) for line in info.splitlines() if "spill" in line
                 for w, nxt in zip(line.split(), line.split()[1:]) if nxt == "bytes" and "spill" in line)
    return {"registers": regs, "spill_bytes": spills, "layout_conversions": compiled.asm["ttgir"].count("convert_layout"),
            "programs_per_sm": 65536 // (regs * 32 * warps)}


def kernels(qt: int) -> list[tuple[str, object, dict, int]]:
    """(name, kernel, constexprs, warps) as the worker launches them for weights of type qt."""
    act = {"ACT": 0, "GU_BIAS": False, "DOWN_BIAS": False}
    g = moe_grouped
    extra = [
        (f"grouped {name} (prompt, {bm}x{bn} tiles)", kernel,
         {"BM": bm, "BN": bn, "BK": g.BK, "PRECISION": precision, "OPERAND": triton.language.bfloat16, **more},
         g.WARPS)
        for bm, bn, precision in ((g.BM, g.BN, g.PRECISION), (g.BM_WIDE, g.BN_WIDE, g.PRECISION_WIDE))
        for name, kernel, more in (("gate/up", g._matrix_kernel, {}), ("down", g._down_kernel, act))
    ] if qt == moe_grouped.MXFP4 else []  # the prompt's on-chip products decode MXFP4 only
    if qt == int(GGMLQuantizationType.Q8_0):  # trunk matrices of 256-value multiples, as placed on the GPU
        extra.append(("matvec regrouped (trunk)", linear_tl._matvec_q8_0r_kernel, {"BN": linear_tl.BN_REGROUPED},
                        linear_tl.MATVEC_WARPS))
    return [
        ("matvec (trunk)", linear_tl._matvec_kernel, {"QT": qt, "BN": linear_tl.BN_MATVEC, "CH": CHUNK},
         linear_tl.MATVEC_WARPS),
        ("experts gate+up (decode)", moe_tl._gate_up_kernel,
         {"QG": qt, "QU": qt, "HAS_PAIRS": False, "BN": moe_tl.BN, "CH": CHUNK}, moe_tl.WARPS),
        ("experts down (decode)", moe_tl._down_kernel,
         {"QD": qt, "SPLITS": 2, "HAS_PAIRS": False, "BN": moe_tl.BN, "CH": CHUNK, **act}, moe_tl.WARPS),
        ("tiles gate+up (prompt)", moe_tiles._gate_up_kernel,
         {"QG": qt, "QU": qt, "G": moe_tiles.G, "BN": moe_tiles.BN, "CH": CHUNK}, moe_tiles.WARPS),
        ("tiles down (prompt)", moe_tiles._down_kernel,
         {"QD": qt, "G": moe_tiles.G, "BN": moe_tiles.BN, "CH": CHUNK, **act}, moe_tiles.WARPS),
        ("dequantize experts (dense)", moe_dense._dequant_blocks_kernel,
         {"QT": qt, "BN": moe_dense.BN_DEQUANT, "CH": CHUNK}, 4),
        *((f"dense {name} (prompt, float32)", kernel,
           {"BM": moe_dense.BM, "BN": moe_dense.BN, "BK": moe_dense.BK, "PRECISION": moe_dense.PRECISION, **more},
           moe_dense.WARPS)  # the dequantized experts' products, the same for every type
          for name, kernel, more in (("gate/up", moe_dense._grouped_gate_up_kernel, {}),
                                     ("down", moe_dense._grouped_down_kernel, act))),
    ] + extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90 (H100, H200)")
    p.add_argument("--types", default="Q4_K,Q8_0", help="ggml types of the weights, comma-separated")
    args = p.parse_args(argv)
    try:
        types = [GGMLQuantizationType[t] for t in args.types.split(",")]
    except KeyError as e:
        p.error(f"unknown ggml type {e}")
    rows = []
    for qt in types:
        for name, fn, consts, warps in kernels(int(qt)):
            rows.append({"kernel": name, "type": qt.name, "warps": warps, **compile_report(fn, consts, warps, args.arch)})
    print(f"{'kernel':<28} {'type':<6} {'warps':>5} {'registers':>9} {'spill B':>7} {'programs/SM':>11} {'conversions':>11}")
    for r in rows:
        print(f"{r['kernel']:<28} {r['type']:<6} {r['warps']:>5} {r['registers']:>9} {r['spill_bytes']:>7} "
              f"{r['programs_per_sm']:>11} {r['layout_conversions']:>11}")
    print(json.dumps({"bench": "kernel_registers", "date": date.today().isoformat(), "arch": args.arch,
                      "triton": triton.__version__, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
