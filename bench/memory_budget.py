#!/usr/bin/env python3
"""Runs a command with a RAM budget, the page cache dropped first: the way two systems that lean on
host memory differently (llama.cpp's `-ncmoe` on mmap'd experts and the page cache; expertd's
mlocked RAM tier) are compared at the same memory (issue 13). The budget is a memory cgroup of
its own (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes` where only v1 is mounted), which
charges the page cache, shared memory and mlocked pages of every process of the command to it;
swap is kept out of it (v2 `memory.swap.max` 0, v1 `memory.memsw.limit_in_bytes` where present).
Needs root. Prints the command's own output, then one JSON line: the budget, the peak the cgroup
recorded, the exit status, the seconds.

  sudo python3 bench/memory_budget.py --gib 16 [--keep-cache] -- llama-bench -m model.gguf -ngl 99 -ncmoe 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GIB = 1 << 30


class BudgetError(RuntimeError):
    """No memory cgroup can be made here; the message says why."""


class MemoryBudget:
    """A memory cgroup of `limit_bytes` for the processes put in it (their children follow)."""

    def __init__(self, limit_bytes: int, name: str | None = None, root: Path = CGROUP_ROOT) -> None:
        self.limit_bytes = limit_bytes
        name = name or f"expertpack-budget-{os.getpid()}"
        if (root / "cgroup.controllers").is_file():  # the unified hierarchy at the root
            self.v2, self.path = True, root / name
            if "memory" not in (root / "cgroup.controllers").read_text().split():
                raise BudgetError(f"{root}: cgroup v2 without the memory controller")
        elif (root / "memory" / "memory.limit_in_bytes").is_file():
            self.v2, self.path = False, root / "memory" / name
        else:
            raise BudgetError(f"no memory cgroup under {root} (neither cgroup v2 nor v1's memory controller)")

    def __enter__(self) -> "MemoryBudget":
        try:
            if self.v2:
                enable = self.path.parent / "cgroup.subtree_control"
                if "memory" not in enable.read_text().split():
                    enable.write_text("+memory")
            self.path.mkdir()
        except OSError as exc:  # EACCES without root; EBUSY or EROFS in a container's own cgroup
            raise BudgetError(f"{exc.filename}: {exc.strerror} (a memory cgroup needs root, and a cgroup v2 "
                              "whose memory controller this process may enable: in a container, run on the host, "
                              "or use systemd-run --scope -p MemoryMax=... -p MemorySwapMax=0)") from None
        try:
            if self.v2:
                (self.path / "memory.max").write_text(str(self.limit_bytes))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit_bytes))
        except OSError as exc:
            self.path.rmdir()
            raise BudgetError(f"{exc.filename}: {exc.strerror}") from None
        return self

    def enter(self) -> None:
        """Puts the calling process in the cgroup (as a child's preexec_fn: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    @property
    def current_bytes(self) -> int | None:
        return self._number("memory.current" if self.v2 else "memory.usage_in_bytes")

    @property
    def peak_bytes(self) -> int | None:
        """The cgroup's own peak (v2 memory.peak, Linux 5.19 or later; v1 memory.max_usage_in_bytes)."""
        return self._number("memory.peak" if self.v2 else "memory.max_usage_in_bytes")

    def _number(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed for the budget (v2 memory.events; v1 memory.oom_control)."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.path / name).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            return 0
        return int(fields.get("oom_kill", 0))

    def kill_all(self) -> None:
        """Ends every process still in the cgroup: a command's children that outlived it (a daemon it
        started, when it was cut off by its timeout) would hold memory into the next run."""
        if self.v2 and (self.path / "cgroup.kill").exists():  # Linux 5.14 or later
            (self.path / "cgroup.kill").write_text("1")
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill_all()
        except OSError as error:
            print(f"memory_budget: could not end what is left in {self.path}: {error}", file=sys.stderr)
        for _ in range(50):  # the processes it held must be gone before it can be removed
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"memory_budget: could not remove {self.path}", file=sys.stderr)


def drop_page_cache() -> None:
    """Writes back dirty pages, then drops the clean page cache, dentries and inodes (a cold start)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except PermissionError:
        raise BudgetError("/proc/sys/vm/drop_caches: permission denied (dropping the page cache needs root)") from None


def run(command: list[str], limit_bytes: int, drop_cache: bool = True, capture: bool = False,
        timeout_s: float | None = None) -> dict:
    """The command's exit status (128 + N when killed by signal N, the kernel's OOM kill included),
    the cgroup's peak and OOM kills, and with `capture` its stdout."""
    if drop_cache:
        drop_page_cache()
    with MemoryBudget(limit_bytes) as budget:
        start = time.monotonic()
        polled = [0]  # where the kernel keeps no peak: the largest of memory.current, 20 times a second
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                polled[0] = max(polled[0], budget.current_bytes or 0)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            proc = subprocess.run(command, preexec_fn=budget.enter, stdout=subprocess.PIPE if capture else None,
                                  text=True, timeout=timeout_s)
            code, stdout = (proc.returncode if proc.returncode >= 0 else 128 - proc.returncode), proc.stdout
        except subprocess.TimeoutExpired as exc:
            code, stdout = 124, exc.stdout if isinstance(exc.stdout, str) else None
        finally:
            done.set()
            poller.join()
        peak = budget.peak_bytes
        return {"budget_bytes": limit_bytes, "peak_bytes": peak if peak is not None else polled[0] or None,
                "peak_from": "the cgroup" if peak is not None else "memory.current, polled",
                "oom_kills": budget.oom_kills,
                "cgroup": "v2" if budget.v2 else "v1", "page_cache_dropped": drop_cache, "returncode": code,
                "seconds": round(time.monotonic() - start, 3), "command": command,
                **({"stdout": stdout} if capture else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, required=True, help="the RAM budget, GiB")
    p.add_argument("--keep-cache", action="store_true", help="do not drop the page cache first (a warm start)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    if not 0 < args.gib < 1 << 20:
        p.error(f"--gib must be a positive number of GiB, not {args.gib}")
    try:
        result = run(command, int(args.gib * GIB), drop_cache=not args.keep_cache)
    except BudgetError as exc:
        print(f"memory_budget: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
