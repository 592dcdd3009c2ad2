#!/usr/bin/env python3
"""How fast the GPU reads host memory, by how that memory was allocated, and what a copy from it
costs kernels running beside it. The warm RAM tier's decode is bound by the table step's gather of
kept blocks over PCIe (routing_tl.expert_lookup); decode_streaming takes its bound from
gather_gb_s here. Each kind of host memory is `--gib` GiB, registered with CUDA where torch did
not allocate it: torch's pinned allocation (cudaHostAlloc), a /dev/shm file mapped and registered
read-only as the worker registers expertd's segment, the same read-write, anonymous memory with
transparent huge pages, and hugetlbfs pages (anonymous, and a /dev/hugepages file that another
process could map by name) where the machine has them (`--reserve-hugepages`, as root, asks for
them). For each: `--rounds` rounds of k random blocks of `--block-mib`, copied into VRAM by DMA
(one copy a block) and by the gather kernel (its bytes checked), in GB/s. Then `--overlap`: the
same copies on a side stream beside HBM-bound kernels, each timed alone and together.
  python3 bench/host_bandwidth.py [--gib 2] [--k 8] [--block-mib 2.53] [--overlap 4,16,64]
Prints the machine's page settings, the tables, then one JSON line."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch

from expertpack.worker.kernels import routing_tl

MAP_HUGETLB = 0x40000  # linux/mman.h, x86 and arm64
CUDA_HOST_REGISTER_READ_ONLY = 0x08
HUGE_2M = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage")


def hugetlbfs_mounts() -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if line.split()[2] == "hugetlbfs"]


def machine_pages() -> dict[str, str]:
    """The settings that decide which page sizes host memory can get."""
    out = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            out[f"thp {name}"] = (THP / name).read_text().strip()
        except OSError as exc:
            out[f"thp {name}"] = f"unreadable ({exc.strerror})"
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    for line in meminfo:
        if line.startswith(("HugePages_Total", "HugePages_Free", "Hugepagesize", "ShmemHugePages", "AnonHugePages")):
            key, value = line.split(":", 1)
            out[key] = value.strip()
    iommu = Path("/sys/class/iommu")
    out["iommu"] = ",".join(sorted(p.name for p in iommu.iterdir())) if iommu.exists() else "none"
    out["hugetlbfs"] = ",".join(hugetlbfs_mounts()) or "none"
    return out


def reserve_hugepages(nbytes: int) -> str:
    """Asks the kernel for enough 2 MiB pages (root only); what it got."""
    want = -(-nbytes // HUGE_2M) + 8
    path = Path("/proc/sys/vm/nr_hugepages")
    try:
        have = int(path.read_text())
        if have < want:
            path.write_text(str(want))
        return f"nr_hugepages {path.read_text().strip()} (asked {want})"
    except OSError as exc:
        return f"nr_hugepages not set: {exc.strerror}"


@contextmanager
def registered(m: mmap.mmap, flags: int) -> Iterator[torch.Tensor]:
    """`m` as a uint8 tensor, page-locked for the GPU (cudaHostRegister with `flags`)."""
    with warnings.catch_warnings():  # a read-only mapping: nothing here writes into it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(m, dtype=torch.uint8)
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), flags))
    if err:
        raise OSError(f"cudaHostRegister failed: error {err}")
    try:
        yield t
    finally:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _fill(m: mmap.mmap) -> None:
    """Touches every page with bytes that differ block to block (the check compares them)."""
    view = torch.frombuffer(m, dtype=torch.uint8)
    view.copy_(_random_bytes(len(m)))
    del view


def _random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@contextmanager
def host_memory(kind: str, nbytes: int) -> Iterator[torch.Tensor]:
    """`nbytes` of host memory of `kind`, filled, as a tensor the GPU can read (pinned)."""
    if kind == "cudaHostAlloc":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t.copy_(_random_bytes(nbytes))
        yield t
        return
    path: Path | None = None
    if kind.startswith("shm"):
        path = Path("/dev/shm") / f"host-bandwidth-{os.getpid()}"
    elif kind == "hugetlbfs file":
        mounts = hugetlbfs_mounts()
        if not mounts:
            raise OSError("no hugetlbfs mounted")
        path = Path(mounts[0]) / f"host-bandwidth-{os.getpid()}"
    try:
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)  # too little room raises here, not SIGBUS while filling
                m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            if kind == "shm + MADV_HUGEPAGE":
                m.madvise(mmap.MADV_HUGEPAGE)
        elif kind == "anon + MADV_HUGEPAGE":
            m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
        elif kind == "anon MAP_HUGETLB":
            m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
        else:
            raise ValueError(kind)
        _fill(m)
        flags = 0
        if kind == "shm read-only":  # as the worker maps expertd's segment: a second, read-only mapping
            fd = os.open(path, os.O_RDONLY)
            try:
                m, filled = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ), m
            finally:
                os.close(fd)
            filled.close()
            flags = CUDA_HOST_REGISTER_READ_ONLY
        with registered(m, flags) as t:
            yield t  # the mapping goes when the last tensor over it does
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def huge_share() -> str:
    """The machine's huge page counters (/proc/meminfo) with this kind's memory made and filled:
    beside the counters printed at start, whether the kind got huge pages."""
    info = {line.split(":")[0]: line.split(":")[1].strip() for line in Path("/proc/meminfo").read_text().splitlines()}
    return f"AnonHuge {info.get('AnonHugePages')}, ShmemHuge {info.get('ShmemHugePages')}, " \
           f"HugePages_Free {info.get('HugePages_Free')}"


def timed(fn: Callable[[], None], rounds: int) -> float:
    """Seconds of GPU time a round of `fn`: each round held behind a sleeping kernel until it is
    enqueued, so that launch time is not counted where the copies are small."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    spent_ms = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000)  # ~0.5 ms
        start.record()
        fn()
        end.record()
        end.synchronize()
        spent_ms += start.elapsed_time(end)
    return spent_ms / 1e3 / rounds


def measure(host: torch.Tensor, k: int, block: int, rounds: int, device: torch.device) -> dict[str, float]:
    """GB/s of k random blocks a round into VRAM: DMA copies, then the table step's gather kernel."""
    n_blocks = host.numel() // block
    rng = random.Random(1)
    picks = [rng.sample(range(n_blocks), k) for _ in range(rounds + 1)]
    pool = torch.empty(2 * k * block, dtype=torch.uint8, device=device)  # k "resident" slots, then k transit
    resident_bytes = k * block
    turn = iter(range(10**9))

    def dma() -> None:
        p = picks[next(turn) % len(picks)]
        for i, b in enumerate(p):
            pool[i * block:(i + 1) * block].copy_(host[b * block:(b + 1) * block], non_blocking=True)

    dma_s = timed(dma, rounds)
    base = host.data_ptr() - pool.data_ptr()
    rows = [torch.tensor([base + b * block for b in p], dtype=torch.int64, device=device) for p in picks]
    ids = torch.arange(k, device=device)
    rec = torch.zeros(2, k, dtype=torch.int64, device=device)

    def gather() -> None:
        row = rows[next(turn) % len(rows)]
        routing_tl.expert_lookup(ids, row, rec[0], rec[1], pool, resident_bytes, block, block)

    gather_s = timed(gather, rounds)
    gather()  # check the last round's bytes
    torch.cuda.synchronize()
    last = picks[(next(turn) - 1) % len(picks)]
    for i, b in enumerate(last):
        got = pool[resident_bytes + i * block: resident_bytes + (i + 1) * block].cpu()
        if not torch.equal(got, host[b * block:(b + 1) * block]):
            raise SystemExit("the gather kernel's copy differs from the host bytes")
    return {"dma_gb_s": k * block / dma_s / 1e9, "gather_gb_s": k * block / gather_s / 1e9}


def overlap(host: torch.Tensor, k: int, block: int, rounds: int, device: torch.device,
            programs: list[int]) -> list[dict]:
    """What a copy of k host blocks on a side stream does to HBM-bound kernels running beside it
    (as copies ahead of the next layer run beside this layer's): 48 matvecs over 96 MB of float16
    (more than L2) alone, the copy alone, then both at once, for DMA copies and for the gather
    kernel at each count of programs a block. Times in microseconds a round."""
    n_blocks = host.numel() // block
    rng = random.Random(2)
    picks = [rng.sample(range(n_blocks), k) for _ in range(rounds + 1)]
    pool = torch.empty(2 * k * block, dtype=torch.uint8, device=device)
    resident_bytes = k * block
    base = host.data_ptr() - pool.data_ptr()
    rows = [torch.tensor([base + b * block for b in p], dtype=torch.int64, device=device) for p in picks]
    ids = torch.arange(k, device=device)
    rec = torch.zeros(2, k, dtype=torch.int64, device=device)
    mats = [torch.randn(2048, 2048, dtype=torch.float16, device=device) for _ in range(12)]
    v = torch.randn(2048, dtype=torch.float16, device=device)
    side = torch.cuda.Stream(device)
    turn = iter(range(10**9))

    def compute() -> None:
        for i in range(48):
            torch.mv(mats[i % len(mats)], v)

    def copier(p: int | None) -> Callable[[], None]:
        def dma() -> None:
            pick = picks[next(turn) % len(picks)]
            for i, b in enumerate(pick):
                pool[i * block:(i + 1) * block].copy_(host[b * block:(b + 1) * block], non_blocking=True)

        def gather() -> None:
            routing_tl.GATHER_PROGRAMS = p
            routing_tl.expert_lookup(ids, rows[next(turn) % len(rows)], rec[0], rec[1], pool, resident_bytes, block,
                                     block)
        return dma if p is None else gather

    def gated(copy: Callable[[], None] | None, work: Callable[[], None] | None) -> tuple[float, float]:
        """Microseconds a round of `work` on the main stream and `copy` on the side, both held
        behind a sleeping kernel until all is enqueued: GPU time, not launch time."""
        main = torch.cuda.current_stream(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        spent_c = spent_x = 0.0
        for r in range(rounds + 1):
            torch.cuda.synchronize()
            torch.cuda._sleep(4_000_000)  # ~2 ms
            events[0].record(main)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if copy is not None:
                    copy()
                events[2].record(side)
            if work is not None:
                work()
            events[1].record(main)
            torch.cuda.synchronize()
            if r:  # the first round warms up
                spent_c += events[0].elapsed_time(events[1])
                spent_x += events[0].elapsed_time(events[2])
        return spent_c * 1e3 / rounds, spent_x * 1e3 / rounds

    saved = routing_tl.GATHER_PROGRAMS
    out = []
    try:
        alone_compute = gated(None, compute)[0]
        for p in [None, *programs]:
            copy = copier(p)
            alone_copy = gated(copy, None)[1]
            with_compute, with_copy = gated(copy, compute)
            out.append({"copy": "DMA" if p is None else f"gather, {p} programs a block", "compute_us": alone_compute,
                        "copy_us": alone_copy, "compute_beside_us": with_compute, "copy_beside_us": with_copy})
    finally:
        routing_tl.GATHER_PROGRAMS = saved
    return out


def gather_gb_s(device: torch.device, k: int, block: int, gib: float = 0.5, rounds: int = 30) -> float:
    """The rate at which the table step's gather brings k blocks of `block` bytes from pinned host
    memory into VRAM on this machine: the PCIe bound of a decode that reads the RAM tier."""
    block = -(-block // 4096) * 4096  # as the tier's slots: aligned for the kernel's 16-byte loads
    nbytes = max(int(gib * 2**30), 4 * k * block)
    with torch.cuda.device(device), host_memory("cudaHostAlloc", nbytes) as host:
        rate = measure(host, k, block, rounds, device)["gather_gb_s"]
    del host
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
    if empty_host_cache is not None:  # the pinned block back to the system before the runs
        empty_host_cache()
    return rate


KINDS = ("cudaHostAlloc", "shm read-only", "shm", "shm + MADV_HUGEPAGE", "anon + MADV_HUGEPAGE", "anon MAP_HUGETLB",
         "hugetlbfs file")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="host memory of each kind (default 2)")
    p.add_argument("--k", type=int, default=8, help="blocks a round, as a layer's experts (default 8)")
    p.add_argument("--block-mib", type=float, default=2.53, help="block size (default 2.53: a Q3 Q4_K expert)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--reserve-hugepages", action="store_true",
                   help="as root, raise vm.nr_hugepages so that the hugetlbfs kinds can run")
    p.add_argument("--overlap", metavar="P,P,...", default="4,8,16,32,64",
                   help="gather programs a block to run beside HBM-bound kernels, from cudaHostAlloc memory "
                        "(empty: skip)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_bandwidth needs a CUDA device")
    device = torch.device("cuda")
    nbytes = int(args.gib * 2**30) // HUGE_2M * HUGE_2M
    block = int(args.block_mib * 2**20) // 4096 * 4096
    pages = machine_pages()
    if args.reserve_hugepages:
        pages["reserved"] = reserve_hugepages(nbytes)
    for key, value in pages.items():
        print(f"{key:16} {value}")
    rows = []
    print(f"{'host memory':24} {'DMA GB/s':>9} {'gather GB/s':>12}  pages after filling")
    for kind in args.kinds.split(","):
        try:
            with host_memory(kind, nbytes) as host:
                pages_now = huge_share()
                r = measure(host, args.k, block, args.rounds, device)
            del host  # unmapped before the next kind is made (hugetlbfs pages are reserved for one kind)
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"{kind:24} {'-':>9} {'-':>12}  not run: {exc}")
            rows.append({"kind": kind, "error": str(exc)})
            continue
        print(f"{kind:24} {r['dma_gb_s']:9.2f} {r['gather_gb_s']:12.2f}  {pages_now}")
        rows.append({"kind": kind, **r, "pages": pages_now})
    beside = []
    if args.overlap:
        with host_memory("cudaHostAlloc", nbytes) as host:
            beside = overlap(host, args.k, block, args.rounds, device, [int(p) for p in args.overlap.split(",")])
        print(f"\n{'copy of k blocks beside 48 matvecs (us)':40} {'compute':>8} {'copy':>8} {'compute beside':>15} "
              f"{'copy beside':>12}")
        for r in beside:
            print(f"{r['copy']:40} {r['compute_us']:8.1f} {r['copy_us']:8.1f} {r['compute_beside_us']:15.1f} "
                  f"{r['copy_beside_us']:12.1f}")
    print(json.dumps({"bench": "host_bandwidth", "date": date.today().isoformat(),
                      "gpu": torch.cuda.get_device_name(device), "gib": args.gib, "k": args.k, "block": block,
                      "pages": pages, "rows": rows, "overlap": beside}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
