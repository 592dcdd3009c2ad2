"""What the block device under a file did between two moments, from the kernel's own counters
(/sys/dev/block/MAJ:MIN/stat, the fields of /proc/diskstats): bytes read, the share of the time it
had at least one request in flight (iostat's %util) and the mean number in flight. A streaming run
below its I/O bound left the disk idle (utilization under 1), or kept it busy with fewer reads in
flight than the bound's measurement had (an SSD or a virtual disk is not saturated at 100%
utilization), or both. The device is the one under the file itself; a partition's counters leave
out its siblings' load."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512  # the unit of the stat file's sector counts, whatever the device's own sector size


@dataclass(frozen=True)
class DiskSample:
    at_s: float
    read_sectors: int
    io_ticks_ms: int  # time with at least one request in flight
    queue_ms: int  # time_in_queue: the integral of the requests in flight


@dataclass(frozen=True)
class DiskActivity:
    seconds: float
    read_bytes: int
    utilization: float  # busy time / elapsed time
    mean_in_flight: float
    busy_gb_per_s: float  # bytes read per busy second

    def describe(self) -> str:
        return (f"disk busy {self.utilization:.0%} of {self.seconds:.2f} s, {self.mean_in_flight:.1f} requests in flight "
                f"on average, {self.read_bytes / 1e6:.0f} MB read, {self.busy_gb_per_s:.2f} GB/s while busy")


class DiskCounters:
    """The stat file of the device (or partition) that holds `path`; None where there is none
    (tmpfs, overlay, a network filesystem): see `open`."""

    def __init__(self, stat_file: Path) -> None:
        self.stat_file = stat_file

    @classmethod
    def open(cls, path: Path) -> "DiskCounters | None":
        dev = os.stat(path).st_dev
        stat_file = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
        return cls(stat_file) if stat_file.exists() else None

    def sample(self) -> DiskSample:
        f = self.stat_file.read_text().split()
        return DiskSample(time.perf_counter(), int(f[2]), int(f[9]), int(f[10]))

    @staticmethod
    def between(a: DiskSample, b: DiskSample) -> DiskActivity:
        seconds = b.at_s - a.at_s
        busy_s = (b.io_ticks_ms - a.io_ticks_ms) / 1e3
        read = (b.read_sectors - a.read_sectors) * SECTOR
        return DiskActivity(seconds, read, busy_s / seconds if seconds else 0.0,
                            (b.queue_ms - a.queue_ms) / 1e3 / seconds if seconds else 0.0,
                            read / busy_s / 1e9 if busy_s else 0.0)
