"""`expertctl`: ops tooling for a running expertd. `stats` prints a table for people (throughput,
latency percentiles, errors, clients, slots, the RAM tier) or JSON for scripts; `ping` prints the round trip;
`health` exits 0 when the daemon answers and has seen no I/O errors and no corrupt blocks, 1 when it
answers but is degraded, 2 when it does not answer. Never leases slots (STATS and PING need no HELLO)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from . import protocol as p
from .client import DEFAULT_ENDPOINT
from .ipc import ipc_problem

EXIT_OK, EXIT_DEGRADED, EXIT_DOWN = 0, 1, 2


class Unreachable(Exception):
    """Nobody answers at the endpoint: no socket file, a socket nobody accepts on, or no reply in time."""


class Probe:
    """A session-less DEALER for STATS and PING."""

    def __init__(self, endpoint: str, timeout_s: float, curve_server_key: bytes | None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://"):
            if curve_server_key is None:
                self.sock.close(0)
                raise ValueError(f"{endpoint}: expertd encrypts TCP; pass --curve-server-key FILE (its public key)")
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_key)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise ValueError(f"cannot use endpoint {endpoint!r}: {exc} (expected ipc://PATH or tcp://HOST:PORT)") from None

    def check(self) -> None:
        """Unreachable at once when an ipc:// socket file is missing or nobody accepts on it: ZeroMQ
        would wait the whole timeout for a daemon that is not there."""
        why = ipc_problem(self.endpoint)
        if why is not None:
            raise Unreachable(f"cannot reach expertd at {self.endpoint}: {why}")

    def ask(self, msg: p.Message, reply: type[p.Message]) -> Any:
        self.sock.send(p.encode(msg))
        if not self.sock.poll(self.timeout_ms):
            why = ipc_problem(self.endpoint)
            raise Unreachable(f"no answer from expertd at {self.endpoint} within {self.timeout_ms / 1000:g} s"
                              + (f"; {why}" if why else ""))
        answer = p.decode(self.sock.recv())
        if isinstance(answer, p.Error):
            raise ValueError(f"expertd refused {msg.op.name}: {answer.code.name}: {answer.message}")
        if not isinstance(answer, reply):
            raise ValueError(f"expertd answered {msg.op.name} with {answer.op.name}; is this an expertd endpoint?")
        return answer

    def close(self) -> None:
        self.sock.close(0)


def render(stats: dict[str, Any], previous: dict[str, Any] | None, interval_s: float | None) -> str:
    c = stats["counters"]
    lines = [
        f"expertd pid {stats['pid']}  up {stats['uptime_s']:.0f} s  {stats['arch']}  pack {stats['fingerprint'][:16]}  "
        f"{'O_DIRECT' if stats['direct_io'] else 'BUFFERED (fallback)'}",
        # expertd's `failed` counts every FAIL, a cancel's included: each answer is shown once here
        f"fetches {c['fetches']:,}  keys {c['keys']:,}  ready {c['ready']:,}  cancelled {c['cancelled']:,}  "
        f"failed {c['failed'] - c['cancelled']:,}",
        f"read {c['pack_read_bytes'] / 1e9:,.2f} GB in {c['read_ops']:,} ops  io_errors {c['io_errors']}  "
        f"corrupt_blocks {c.get('corrupt_blocks', 0)}  fallback_count {c['fallback_count']}  "
        f"protocol_errors {c['protocol_errors']}",
        f"checked  {c.get('checked_blocks', 0):,} blocks ({c.get('checked_bytes', 0) / 1e9:,.2f} GB) against their crc32",
    ]
    if previous is not None and interval_s:
        delta = c["pack_read_bytes"] - previous["counters"]["pack_read_bytes"]
        keys = c["ready"] - previous["counters"]["ready"]
        lines.append(f"now      {delta / interval_s / 1e9:.3f} GB/s  {keys / interval_s:,.0f} experts/s")
    for name in ("read_latency_us", "fetch_latency_us"):
        h = stats[name]
        lines.append(f"{name:<17} p50 <= {h['p50']:,.0f}  p99 <= {h['p99']:,.0f}  mean {h['mean']:,.0f}  "
                     f"({h['count']:,} samples)")
    s = stats["slots"]
    lines.append(f"slots    {s['total']} x {s['slot_bytes']:,} B: {s['unleased']} unleased, {s['free']} free, "
                 f"{s['reading']} reading, {s['leased']} leased   queue {stats['queue_depth']['keys']} keys, "
                 f"{stats['queue_depth']['reads']} reads")
    ram = stats.get("ram")  # absent from an expertd before protocol v3
    if ram is not None:
        asked = ram["hits"] + ram["misses"]
        lines.append(f"ram      {ram['slots']} x {s['slot_bytes']:,} B ({ram['size_bytes'] / 1e9:,.2f} GB, "
                     f"{'locked' if ram['locked'] or not ram['slots'] else 'NOT locked: ' + str(ram['lock_error'])}): "
                     f"{ram['resident']} resident ({ram['resident_bytes'] / 1e9:,.2f} GB), {ram['reading']} reading, "
                     f"{ram['held']} held   hits {ram['hits']:,}  misses {ram['misses']:,}  "
                     f"evictions {ram['evictions']:,}  hit rate {ram['hits'] / asked if asked else 0:.1%}")
    lines.append(f"clients  {len(stats['clients'])}")
    lines.extend(client_lines(stats["clients"], previous["clients"] if previous else None, interval_s))
    return "\n".join(lines)


def client_lines(clients: list[dict[str, Any]], previous: list[dict[str, Any]] | None,
                 interval_s: float | None) -> list[str]:
    """Two lines per client: who and what it holds now; then its counters since HELLO (with
    --watch, its experts/s since the last print). An expertd from before per-client counters gets
    the first line only."""
    before = {(c["name"], c.get("pid")): c for c in previous or []}
    width = max([24, *(len(c["name"]) for c in clients)])
    out = []
    for cl in clients:
        pid = cl.get("pid")
        out.append(f"  {cl['name']:<{width}} pid {pid if pid is not None else '?'!s:<7}  slots {cl['slots']:>4}  "
                   f"free {cl['free']:>4}  queued {cl['queued']:>6}"
                   + (f" ({cl['queued_demand']} demand, {cl['queued_prefetch']} prefetch)  ram held "
                      f"{cl['ram_held'] - cl.get('ram_kept', 0)}" + (f" of {cl['ram_share']}" if "ram_share" in cl else "")
                      + (f", kept {cl['ram_kept']} of {cl['ram_keeps']}" if "ram_kept" in cl else "")
                      if "queued_demand" in cl else "")
                   + f"  requests {cl['requests']}")
        if "keys" not in cl:
            continue
        asked = cl["ram_hits"] + cl["ram_misses"]
        lat = cl["demand_latency_us"]
        rate = ""
        old = before.get((cl["name"], pid))
        if old is not None and interval_s:
            rate = f"  now {(cl['ready'] - old['ready']) / interval_s:,.0f} experts/s"
        out.append(f"  {'':<{width}} keys {cl['keys']:,}  ready {cl['ready']:,}  failed or cancelled {cl['failed']:,}  "
                   f"served {size(cl['served_bytes'])}  read {size(cl['read_bytes'])}  "
                   f"ram hits {cl['ram_hits']:,} ({cl['ram_hits'] / asked if asked else 0:.1%})  "
                   f"demand p50 <= {lat['p50']:,.0f} us  p99 <= {lat['p99']:,.0f} us{rate}")
    return out


def size(n_bytes: int) -> str:
    """Bytes for people: MB below a GB (a worker's first minutes), GB above."""
    return f"{n_bytes / 1e9:,.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:,.1f} MB"


def health(stats: dict[str, Any]) -> tuple[int, str]:
    """(exit code, one line) from a STATS reply: degraded when the pack is not what the daemon
    opened (truncated, replaced, removed), reads of it have failed or read corrupt blocks, or
    reads go buffered."""
    c = stats["counters"]
    pack = stats["pack"]
    if pack["size_bytes"] != pack["manifest_size_bytes"]:
        return EXIT_DEGRADED, (f"degraded: the pack is {pack['size_bytes']:,} bytes, its manifest says "
                               f"{pack['manifest_size_bytes']:,} (truncated or replaced; run expertpack verify)")
    if not pack["same_file"]:
        return EXIT_DEGRADED, "degraded: the pack file was removed or replaced since expertd opened it (restart expertd)"
    if c.get("corrupt_blocks"):
        return EXIT_DEGRADED, (f"degraded: {c['corrupt_blocks']} blocks failed their crc32 check and were not served "
                               "(the pack is damaged on disk; run expertpack verify, rebuild or restore it)")
    if c["io_errors"]:
        return EXIT_DEGRADED, f"degraded: {c['io_errors']} I/O errors reading the pack (check the disk, run expertpack verify)"
    if not stats["direct_io"]:
        return EXIT_DEGRADED, f"degraded: reading through the page cache (direct_io = false), {c['fallback_count']} reads"
    return EXIT_OK, f"ok: serving {stats['arch']} pack {stats['fingerprint'][:16]}, {len(stats['clients'])} clients"


COMMANDS = {
    "stats": ("counters, latencies, slots, the RAM tier and every client",
              "Print expertd's counters since it started: keys asked, read and answered, read and fetch latency "
              "percentiles, errors, its staging slots, its RAM tier, and one entry per client (name, pid, slots, "
              "queue, hits). --watch N repeats every N seconds with the rates in between."),
    "ping": ("the round trip to expertd", "Send PING and print how long the PONG took."),
    "health": ("exit 0 ok, 1 degraded, 2 down",
               "Exit 0 when expertd answers and is healthy, 1 when it answers but is degraded (I/O errors, corrupt "
               "blocks, a replaced or truncated pack, reads through the page cache), 2 when it does not answer; "
               "one line says which."),
}


def parser() -> argparse.ArgumentParser:
    """One subcommand each, with its own --help; their shared flags come after the subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help=f"expertd's endpoint (default {DEFAULT_ENDPOINT})")
    common.add_argument("--json", action="store_true", help="one JSON object instead of text")
    common.add_argument("--timeout-s", type=float, default=5.0, metavar="S",
                        help="how long to wait for an answer (default 5); a missing socket is reported at once")
    common.add_argument("--curve-server-key", type=Path, metavar="FILE",
                        help="expertd's CurveZMQ public key file (zmq certificate), for tcp:// endpoints")
    top = argparse.ArgumentParser(prog="expertctl", description="Query a running expertd. Never leases slots: "
                                  "safe against a busy daemon.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, description) in COMMANDS.items():
        cmd = sub.add_parser(name, parents=[common], help=summary, description=description)
        if name == "stats":
            cmd.add_argument("--watch", type=float, metavar="N", help="repeat every N seconds, with rates (default: once)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.watch = getattr(args, "watch", None)
    for flag, value, low, high in (("--timeout-s", args.timeout_s, 0.01, 3600.0), ("--watch", args.watch, 0.01, 86400.0)):
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            print(f"expertctl: {flag} must lie in {low:g}..{high:g}, got {value!r}", file=sys.stderr)
            return EXIT_DOWN  # 2, as for any bad input

    try:
        server_key = None
        if args.curve_server_key is not None:
            import zmq.auth

            server_key, _ = zmq.auth.load_certificate(str(args.curve_server_key))
        probe = Probe(args.endpoint, args.timeout_s, server_key)
    except (ValueError, OSError) as exc:
        print(f"expertctl: {exc}", file=sys.stderr)
        return EXIT_DOWN
    try:
        probe.check()
        if args.command == "ping":
            start = time.perf_counter()
            probe.ask(p.Ping(), p.Pong)
            rtt_ms = (time.perf_counter() - start) * 1000
            print(json.dumps({"rtt_ms": rtt_ms}) if args.json else f"pong from {args.endpoint} in {rtt_ms:.2f} ms")
            return EXIT_OK
        if args.command == "health":
            code, text = health(probe.ask(p.Stats(), p.StatsReply).stats)
            print(json.dumps({"status": ("ok", "degraded")[code], "detail": text}) if args.json else text)
            return code
        previous = None
        while True:
            stats = probe.ask(p.Stats(), p.StatsReply).stats
            if args.json:
                print(json.dumps(stats), flush=True)
            else:
                print(render(stats, previous, args.watch), flush=True)
            if not args.watch:
                return EXIT_OK
            previous = stats
            time.sleep(args.watch)
            if not args.json:
                print()
    except Unreachable as exc:
        if args.json and args.command == "health":
            print(json.dumps({"status": "down", "detail": str(exc)}))
        else:
            print(f"expertctl: {exc}", file=sys.stderr)
        return EXIT_DOWN
    except ValueError as exc:  # an ERROR, or not an expertd at all
        print(f"expertctl: {exc}", file=sys.stderr)
        return EXIT_DOWN
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        probe.close()


if __name__ == "__main__":
    sys.exit(main())
