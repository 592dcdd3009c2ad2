#!/usr/bin/env python3
"""Build throughput against `cp` of the same source on the same disk, measured side by side in one
run (cp, build, build, cp, cp, build: drift cancels; medians reported), with the source dropped from the page cache before every
run (posix_fadvise DONTNEED; this machine forbids drop_caches) and every output fsync'ed inside the
timing (cp is followed by `sync FILE`; build syncs its own outputs). Also the peak RSS of the build
process at two model sizes (bounded memory means the two agree), and a cold verify.

Prints a table, then one JSON line with the conditions. Usage:
  .venv/bin/python bench/build_throughput.py [--preset deepseek-v4-flash --layers 6] [--dir bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERTPACK = shutil.which("expertpack") or str(Path(sys.executable).parent / "expertpack")


def drop_cache(path: Path) -> None:
    """Evicts a file's clean pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return elapsed, usage.ru_maxrss * 1024


def run_cp(src: Path, dst: Path) -> tuple[float, int]:
    seconds, rss = timed(["sh", "-c", f'cp "{src}" "{dst}" && sync "{dst}"'])
    dst.unlink()
    return seconds, rss


def run_build(src: Path, out: Path, keep: bool = False) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    result = timed([EXPERTPACK, "build", str(src), "-o", str(out), "-q"])
    if not keep:
        shutil.rmtree(out)
    return result


def synth(preset: str, layers: int | None, path: Path) -> None:
    if path.exists():
        return
    cmd = [EXPERTPACK, "synth", "--preset", preset, "-o", str(path), "-q"]
    if layers:
        cmd += ["--layers", str(layers)]
    subprocess.run(cmd, check=True)


def filesystem_of(path: Path) -> str:
    out = subprocess.run(["df", "--output=fstype,source", str(path)], capture_output=True, text=True).stdout
    return " ".join(out.split()[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v4-flash")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dir", type=Path, default=REPO / "bench-out")
    p.add_argument("--keep-source", action="store_true", help="keep the synthetic source for the next run")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)

    src = args.dir / f"{args.preset}-{args.layers}L.gguf"
    small = args.dir / "small.gguf"
    print(f"synthesizing {src.name} and {small.name} ...", file=sys.stderr)
    synth(args.preset, args.layers, src)
    synth("small", None, small)
    size = src.stat().st_size

    rows = []
    for tool in ("cp", "build", "build", "cp", "cp", "build"):
        drop_cache(src)
        if tool == "cp":
            seconds, rss = run_cp(src, args.dir / "copy.gguf")
        else:
            seconds, rss = run_build(src, args.dir / "pack", keep=True)
        rows.append({"tool": tool, "seconds": seconds, "gb_per_s": size / seconds / 1e9, "peak_rss_bytes": rss})
        print(f"  {tool:<6} {seconds:8.1f} s  {size / seconds / 1e9:6.3f} GB/s  peak RSS {rss / 2**20:8.1f} MiB",
              file=sys.stderr)

    pack = args.dir / "pack"
    drop_cache(pack / "experts.pack")
    verify_s, verify_rss = timed([EXPERTPACK, "verify", str(pack), "-q"])
    pack_bytes = (pack / "experts.pack").stat().st_size
    shutil.rmtree(pack)
    drop_cache(small)
    small_s, small_rss = run_build(small, args.dir / "small-pack")

    cp_s = statistics.median(r["seconds"] for r in rows if r["tool"] == "cp")
    build_s = statistics.median(r["seconds"] for r in rows if r["tool"] == "build")
    build_rss = max(r["peak_rss_bytes"] for r in rows if r["tool"] == "build")
    ratio = cp_s / build_s
    kimi_bytes, kimi_ref_s = 985e9, 29 * 60 + 42
    kimi_s = kimi_bytes / (size / build_s)

    print()
    print(f"source        {src.name}: {size / 1e9:.2f} GB ({args.preset}, {args.layers} layers)")
    print(f"{'run':<8}{'seconds':>10}{'GB/s':>9}{'peak RSS MiB':>15}")
    for r in rows:
        print(f"{r['tool']:<8}{r['seconds']:>10.1f}{r['gb_per_s']:>9.3f}{r['peak_rss_bytes'] / 2**20:>15.1f}")
    print(f"median: cp {cp_s:.1f} s, build {build_s:.1f} s; build / cp throughput ratio: {ratio:.2f}x "
          "(goal >= 0.80x)")
    print(f"peak RSS of build: {build_rss / 2**20:.0f} MiB on {size / 1e9:.1f} GB, "
          f"{small_rss / 2**20:.0f} MiB on {small.stat().st_size / 1e9:.2f} GB (small preset)")
    print(f"verify (cold): {pack_bytes / 1e9:.1f} GB in {verify_s:.1f} s = {pack_bytes / verify_s / 1e9:.2f} GB/s, "
          f"peak RSS {verify_rss / 2**20:.0f} MiB")
    print(f"Kimi-K3 985 GB at this rate: {kimi_s / 60:.1f} min (reference system: 29 min 42 s, "
          f"{kimi_bytes / kimi_ref_s / 1e9:.2f} GB/s)")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({
        "bench": "build_throughput", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu {platform.machine()}",
        "disk": filesystem_of(args.dir), "cache": "cold (fadvise DONTNEED before each run)",
        "model": f"synth {args.preset} --layers {args.layers}", "source_bytes": size,
        "runs": rows, "build_over_cp": round(ratio, 3), "build_peak_rss_bytes": build_rss,
        "small_build_peak_rss_bytes": small_rss, "verify_gb_per_s": round(pack_bytes / verify_s / 1e9, 3),
        "kimi_k3_985gb_minutes": round(kimi_s / 60, 1),
    }))
    if not args.keep_source:
        src.unlink()
        small.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
