"""`expertpack bench io PACK`: how close expertd comes to the disk, measured side by side in one run
on the same pack with the page cache dropped before each path, each path run twice in the order
fio, expertd, buffered, buffered, expertd, fio (the disk's drift cancels; means are reported):

  fio       raw O_DIRECT reads of the same piece size with as many reads in flight (fio threads =
            reader threads), in the same pattern: whole expert blocks at random block boundaries,
            piece after piece (`rw=randread:<splits>`, `blockalign=<block>`); the ceiling
  expertd   a real daemon process serving random experts to a real client, which releases each
            slot as soon as it arrives
  buffered  what systems without a daemon do: pread through the page cache into a buffer, then
            copy into pinned (mlocked) memory, on as many threads

Each run reads experts no other run read (where the pack is large enough), so no layer of caching
below the page cache (a VM host's, a disk's) can favour one path. Throughput is measured with all
keys queued at once; per-expert latency with one top-k request at
a time (one layer's selection at 0% cache hit), p50/p99. CPU-seconds per GB count every process of
the path (daemon + client; fio; the buffered reader). Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from expertpack.client import ExpertClient
from expertpack.daemon.config import RANGES as DAEMON_RANGES
from expertpack.daemon.reader import PackContractError, open_pack
from expertpack.packtools.cli import RANGES as OFFLINE_RANGES, check_ranges
from expertpack.packtools.errors import ExpertpackError
from expertpack.packtools.layout import PACK_FILE, ExpertKey, Manifest

CLK_TCK = os.sysconf("SC_CLK_TCK")

# The range of every numeric flag (by argparse dest), checked with one line before anything runs.
# The reader settings are expertd's own (the daemon is started with them); the bytes stop at a
# terabyte (a run reads them six times), the timed requests at what a run finishes in minutes.
RANGES: dict[str, tuple[float, float]] = {
    "gb": (0.001, 1000.0),
    "read_threads": DAEMON_RANGES["read_threads"],
    "read_splits": DAEMON_RANGES["read_splits"],
    "latency_requests": (1, 100_000),
    "seed": OFFLINE_RANGES["seed"],
}


@dataclass
class PathResult:
    path: str
    gb_per_s: float
    bytes_read: int
    seconds: float
    cpu_s_per_gb: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_of: str  # what one latency sample is


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def percentiles_ms(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return pick(0.5), pick(0.99)


# ---- (a) fio ----------------------------------------------------------------------------------
def run_fio(pack: Path, m: Manifest, piece: int, splits: int, jobs: int, total: int) -> PathResult:
    fio = shutil.which("fio")
    if fio is None:
        raise SystemExit("fio is not installed: apt-get install fio (Debian package)")
    cmd = [fio, "--name=experts", f"--filename={pack / PACK_FILE}", f"--rw=randread:{splits}", "--direct=1",
           f"--blockalign={m.max_stride}", "--ioengine=psync", "--thread", f"--numjobs={jobs}", f"--bs={piece}",
           f"--offset={m.data_start}",
           f"--size={m.pack_size_bytes - m.data_start}", f"--io_size={total // jobs}", "--group_reporting",
           "--randrepeat=0", "--output-format=json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else b""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"fio failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    job = json.loads(out)["jobs"][0]["read"]
    clat = job["clat_ns"]["percentile"]
    nbytes = job["io_bytes"]
    seconds = job["runtime"] / 1000  # fio's own clock: its start-up is not I/O
    return PathResult("fio", nbytes / seconds / 1e9, nbytes, seconds,
                      (usage.ru_utime + usage.ru_stime) / (nbytes / 1e9),
                      clat["50.000000"] / 1e6, clat["99.000000"] / 1e6, f"one {piece:,} B read")


# ---- (b) expertd ------------------------------------------------------------------------------
class DaemonProcess:
    """A real expertd for a benchmark. Without a RAM tier unless `ram_cache_gib` says otherwise:
    what these benchmarks measure is the SSD path, and a tier would answer repeated keys from
    memory."""

    def __init__(self, pack: Path, workdir: Path, threads: int, splits: int, slots: int,
                 ram_cache_gib: float | None = 0.0, client_slots: int | None = None) -> None:
        """ram_cache_gib None: expertd's own default tier; client_slots None: every slot to one client."""
        workdir = Path(tempfile.mkdtemp(dir=workdir))  # one per daemon: socket paths are not reused
        self.endpoint = f"ipc://{workdir}/bench.sock"
        notify_path = workdir / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(notify_path))
        self.notify.settimeout(60)
        expertd = shutil.which("expertd") or str(Path(sys.executable).parent / "expertd")
        self.log = open(workdir / "expertd.log", "w")
        self.proc = subprocess.Popen(
            [str(expertd), "--pack", str(pack), "--endpoint", self.endpoint, "--read-threads", str(threads),
             "--read-splits", str(splits), "--stage-slots", str(slots), "--client-slots", str(client_slots or slots),
             *(() if ram_cache_gib is None else ("--ram-cache-gib", repr(ram_cache_gib)))],
            stdout=self.log, stderr=self.log, env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
        try:
            while b"READY=1" not in self.notify.recv(4096):
                pass
        except TimeoutError:
            self.stop()
            raise SystemExit(f"expertd did not become ready; see {workdir / 'expertd.log'}") from None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.notify.close()
        self.log.close()


def run_daemon(pack: Path, m: Manifest, keys: list[ExpertKey], batches: list[list[ExpertKey]], threads: int,
               splits: int, workdir: Path) -> PathResult:
    daemon = DaemonProcess(pack, workdir, threads, splits, slots=max(16, 4 * threads))
    try:
        with ExpertClient(daemon.endpoint, name="bench-io") as client:
            before = client.stats()["counters"]["pack_read_bytes"]
            cpu0 = process_cpu_s(daemon.proc.pid) + self_cpu_s()
            start = time.perf_counter()
            for expert in client.fetch(keys):
                expert.release()
            seconds = time.perf_counter() - start
            cpu = process_cpu_s(daemon.proc.pid) + self_cpu_s() - cpu0
            nbytes = client.stats()["counters"]["pack_read_bytes"] - before
            drop_cache(pack / PACK_FILE)
            samples = []
            for batch in batches:
                t0 = time.perf_counter()
                for expert in client.fetch(batch):
                    samples.append(time.perf_counter() - t0)
                    expert.release()
    finally:
        daemon.stop()
    p50, p99 = percentiles_ms(samples)
    return PathResult("expertd", nbytes / seconds / 1e9, nbytes, seconds, cpu / (nbytes / 1e9), p50, p99,
                      f"one expert of a top-{len(batches[0])} request")


# ---- (c) buffered -----------------------------------------------------------------------------
def run_buffered(pack: Path, m: Manifest, keys: list[ExpertKey], batches: list[list[ExpertKey]],
                 threads: int) -> PathResult:
    fd = os.open(pack / PACK_FILE, os.O_RDONLY)
    stride = m.max_stride
    pinned = mmap.mmap(-1, threads * stride)
    address = ctypes.addressof(ctypes.c_char.from_buffer(pinned))
    libc = ctypes.CDLL(None, use_errno=True)
    locked = libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(len(pinned))) == 0
    view = memoryview(pinned)
    local = threading.local()
    counter = iter(range(threads))
    lock = threading.Lock()

    def read_one(key: ExpertKey) -> int:
        if not hasattr(local, "slot"):
            with lock:
                local.slot = next(counter)
        layer = m.layer(key.layer)
        data = os.pread(fd, layer.stride, layer.block_offset(key.expert))  # page cache -> buffer
        view[local.slot * stride:local.slot * stride + len(data)] = data  # buffer -> pinned memory
        return len(data)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            cpu0 = self_cpu_s()
            start = time.perf_counter()
            nbytes = sum(pool.map(read_one, keys))
            seconds = time.perf_counter() - start
            cpu = self_cpu_s() - cpu0
            drop_cache(pack / PACK_FILE)
            samples = []
            for batch in batches:
                t0 = time.perf_counter()
                futures = [pool.submit(read_one, k) for k in batch]
                for f in futures:
                    f.result()
                    samples.append(time.perf_counter() - t0)
    finally:
        view.release()
        os.close(fd)
    p50, p99 = percentiles_ms(samples)
    note = "" if locked else " (mlock refused: pinned buffer not locked)"
    return PathResult("buffered", nbytes / seconds / 1e9, nbytes, seconds, cpu / (nbytes / 1e9), p50, p99,
                      f"one expert of a top-{len(batches[0])} request{note}")


def _mean(results: list[PathResult]) -> PathResult:
    n = len(results)
    return PathResult(
        results[0].path, sum(r.gb_per_s for r in results) / n, sum(r.bytes_read for r in results) // n,
        sum(r.seconds for r in results) / n, sum(r.cpu_s_per_gb for r in results) / n,
        sum(r.latency_p50_ms for r in results) / n, sum(r.latency_p99_ms for r in results) / n, results[0].latency_of)


# ---- driver -----------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertpack bench io", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pack", type=Path, help="a pack directory on the disk to measure")
    p.add_argument("--gb", type=float, default=2.5, help="bytes of random experts per run (default 2.5 GB)")
    p.add_argument("--read-threads", type=int, default=8, metavar="N",
                   help="daemon reader threads = fio jobs = buffered threads (default 8)")
    p.add_argument("--read-splits", type=int, default=4, metavar="N",
                   help="pieces per expert block, fio's block size the block over N (default 4)")
    p.add_argument("--latency-requests", type=int, default=30, metavar="N",
                   help="top-k requests timed one at a time (default 30)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random choice of experts each run reads (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_ranges(args, RANGES)
        opened = open_pack(args.pack, direct_io=True, read_splits=args.read_splits)  # what expertd checks at start
        opened.close()
        m = opened.manifest
    except (ExpertpackError, PackContractError, OSError) as exc:
        print(f"expertpack bench io: {exc}", file=sys.stderr)
        return 2

    stride = m.max_stride
    everything = [ExpertKey(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]
    rng = random.Random(args.seed)
    rng.shuffle(everything)
    n = max(1, min(len(everything), int(args.gb * 1e9 // stride)))
    # Run after run takes experts not read before while they last, then starts over (a small pack).
    fresh = itertools.cycle(everything)
    k = m.model.n_expert_used
    piece = -(-stride // args.read_splits // 4096) * 4096
    total = n * stride

    print(f"pack {args.pack}: {m.model.arch}, {len(everything):,} experts of {stride:,} B; measuring {n:,} random "
          f"experts ({total / 1e9:.1f} GB) per path, {args.read_threads} reads in flight", file=sys.stderr)
    runs: dict[str, list[PathResult]] = {"fio": [], "expertd": [], "buffered": []}
    with tempfile.TemporaryDirectory(prefix="bench-io-") as tmp:
        for name in ("fio", "expertd", "buffered", "buffered", "expertd", "fio"):
            drop_cache(args.pack / PACK_FILE)
            if name == "fio":
                r = run_fio(args.pack, m, piece, args.read_splits, args.read_threads, total)
            else:
                keys = [next(fresh) for _ in range(n)]
                batches = [[next(fresh) for _ in range(k)] for _ in range(args.latency_requests)]
                if name == "expertd":
                    r = run_daemon(args.pack, m, keys, batches, args.read_threads, args.read_splits, Path(tmp))
                else:
                    r = run_buffered(args.pack, m, keys, batches, args.read_threads)
            runs[name].append(r)
            print(f"  {r.path:<9} {r.gb_per_s:7.3f} GB/s  {r.cpu_s_per_gb:6.3f} CPU-s/GB  "
                  f"p50 {r.latency_p50_ms:7.2f} ms  p99 {r.latency_p99_ms:7.2f} ms", file=sys.stderr)
    results = [_mean(runs[name]) for name in ("fio", "expertd", "buffered")]
    fio, daemon, buffered = results
    print(f"{'path':<10}{'GB/s':>8}{'CPU-s/GB':>10}{'p50 ms':>9}{'p99 ms':>9}  latency sample")
    for r in results:
        print(f"{r.path:<10}{r.gb_per_s:>8.3f}{r.cpu_s_per_gb:>10.3f}{r.latency_p50_ms:>9.2f}"
              f"{r.latency_p99_ms:>9.2f}  {r.latency_of}")
    ratio = daemon.gb_per_s / fio.gb_per_s
    # CPU time is counted in clock ticks: a run too short to register any is reported as such.
    cpu_ratio = daemon.cpu_s_per_gb / buffered.cpu_s_per_gb if buffered.cpu_s_per_gb else None
    print(f"expertd / fio throughput: {ratio:.2f}x (goal >= 0.9x)")
    print("expertd / buffered CPU per GB: "
          + (f"{cpu_ratio:.2f}x (goal <= 0.5x)" if cpu_ratio is not None else "not measurable: too little work"))
    disk = subprocess.run(["df", "--output=fstype,source", str(args.pack)], capture_output=True, text=True).stdout
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "bench": "io", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu {platform.machine()}", "disk": " ".join(disk.split()[2:]),
        "cache": "cold (fadvise DONTNEED before each path)", "model": m.model.arch, "block_bytes": stride,
        "experts": n, "read_threads": args.read_threads, "read_splits": args.read_splits,
        "results": [asdict(r) for r in results], "runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
        "expertd_over_fio": round(ratio, 3),
        "expertd_cpu_over_buffered": None if cpu_ratio is None else round(cpu_ratio, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
