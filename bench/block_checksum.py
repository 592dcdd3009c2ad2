#!/usr/bin/env python3
"""The CPU cost of expertd's read-time block check (format 1.1's crc32, `layout.block_crc32`), per
GB checked, on one thread, beside sha256 (what `expertpack verify` computes) for scale. Buffers are
random bytes in memory (the check runs on the staging slot the block was just read into), at block
sizes from a small expert to a DeepSeek-V4-Flash one; with --pack DIR also every block of that pack,
read first (page cache) and then checked against its manifest. CPU time is the checking thread's
own (time.thread_time), so other load on the machine does not count.

Prints a table, then one JSON line with the conditions. Usage:
  .venv/bin/python bench/block_checksum.py [--seconds 1.0] [--pack DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import zlib
from datetime import date
from pathlib import Path

from expertpack.packtools.layout import PACK_FILE, Manifest, block_crc32

REPO = Path(__file__).resolve().parents[1]
SIZES = (1 << 16, 1 << 20, 13_369_344, 64 << 20)  # 13,369,344 B: a DeepSeek-V4-Flash expert block


def cpu_s_per_gb(check, data: memoryview, seconds: float) -> tuple[float, float]:
    """(CPU seconds per GB, GB/s of that thread's CPU time), run for at least `seconds` of CPU."""
    done = 0
    start = time.thread_time()
    while (elapsed := time.thread_time() - start) < seconds:
        check(data)
        done += data.nbytes
    elapsed = time.thread_time() - start
    return elapsed / (done / 1e9), done / 1e9 / elapsed


def sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def pack_check(pack: Path) -> tuple[int, int, float]:
    """(blocks, bytes, CPU seconds) to check every block of `pack` against its crc32s."""
    manifest = Manifest.load(pack)
    if not manifest.has_crc32:
        raise SystemExit(f"{pack}: built before format 1.1, no crc32s to check")
    blocks = nbytes = 0
    cpu = 0.0
    with open(pack / PACK_FILE, "rb") as f:
        for layer in manifest.layers:
            for e in range(manifest.model.n_expert):
                f.seek(layer.block_offset(e))
                data = memoryview(f.read(layer.payload_bytes))
                start = time.thread_time()
                ok = block_crc32(data) == layer.crc32[e]
                cpu += time.thread_time() - start
                if not ok:
                    raise SystemExit(f"{pack}: layer {layer.layer} expert {e} fails its crc32 check")
                blocks += 1
                nbytes += data.nbytes
    return blocks, nbytes, cpu


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per measurement (default 1)")
    parser.add_argument("--pack", type=Path, help="also check every block of this pack")
    args = parser.parse_args(argv)

    rows = []
    print(f"{'block bytes':>12}  {'crc32 CPU-s/GB':>14}  {'crc32 GB/s':>10}  {'sha256 CPU-s/GB':>15}  {'sha256 GB/s':>11}")
    for size in SIZES:
        data = memoryview(os.urandom(size))
        crc_cost, crc_rate = cpu_s_per_gb(block_crc32, data, args.seconds)
        sha_cost, sha_rate = cpu_s_per_gb(sha256, data, args.seconds)
        rows.append({"block_bytes": size, "crc32_cpu_s_per_gb": round(crc_cost, 4), "crc32_gb_s": round(crc_rate, 3),
                     "sha256_cpu_s_per_gb": round(sha_cost, 4), "sha256_gb_s": round(sha_rate, 3)})
        print(f"{size:>12,}  {crc_cost:>14.3f}  {crc_rate:>10.2f}  {sha_cost:>15.3f}  {sha_rate:>11.2f}")
    pack = None
    if args.pack is not None:
        blocks, nbytes, cpu = pack_check(args.pack)
        pack = {"path": str(args.pack), "blocks": blocks, "bytes": nbytes, "crc32_cpu_s_per_gb": round(cpu / (nbytes / 1e9), 4)}
        print(f"pack {args.pack}: {blocks} blocks, {nbytes / 1e9:.3f} GB checked, "
              f"{pack['crc32_cpu_s_per_gb']:.3f} CPU-s/GB (all match)")
    print(json.dumps({"bench": "block_checksum", "date": date.today().isoformat(), "commit": commit(),
                      "machine": platform.node(), "cpu": cpu_model(), "cpus": os.cpu_count(),
                      "python": platform.python_version(), "zlib": zlib.ZLIB_RUNTIME_VERSION,
                      "rows": rows, "pack": pack}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
