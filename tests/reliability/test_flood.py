"""A flood of requests from one peer does not grow expertd's memory without a bound. expertd reads
every connection without a high-water mark (libzmq issue 4841), so what a peer sends faster than
the main loop handles queues inside libzmq: one DEALER sending STATS as fast as it can for 8 s grew
the daemon by ~600 MB here before daemon/flood.py cut such connections. Now the connection is cut
once expertd's heap has grown FLOOD_GROWTH_BYTES while the loop was saturated; the daemon's RSS stays bounded, a client
that plays by the rules is served throughout, and the flooder is told nothing but a closed
connection (a reconnecting flooder is cut again)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import zmq

from expertpack.client import ExpertClient
from expertpack.daemon.flood import FLOOD_GROWTH_BYTES

from ..conftest import Daemon
from ..helpers.expertd import wait_stats

FLOOD_S = 8.0

FLOODER = """
import sys, time, zmq
from expertpack.client import protocol as p

def connect():
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)  # reads nothing: the replies are the daemon's to hold or drop
    s.setsockopt(zmq.SNDTIMEO, 500)  # a cut connection leaves no peer: send blocks, then Again
    s.connect(sys.argv[1])
    return s

s = connect()
msg, sent, connections, end = p.encode(getattr(p, sys.argv[3])()), 0, 1, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        s.send(msg)
        sent += 1
    except zmq.Again:  # cut: a new connection floods on
        s.close()
        s = connect()
        connections += 1
print(sent, connections, flush=True)
"""


def test_a_flooding_peer_is_cut_and_memory_stays_bounded(daemon: Daemon) -> None:
    proc = psutil.Process(daemon.proc.pid)
    with ExpertClient(daemon.endpoint, name="bystander", timeout_s=30) as client:
        client.stats()
        rss_start = proc.memory_info().rss
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, daemon.endpoint, str(FLOOD_S), "Stats"],
                                   stdout=subprocess.PIPE, text=True)
        try:
            served, peak = 0, rss_start
            while flooder.poll() is None:
                for expert in client.fetch([(served % 4, served % 16)]):  # served while the flood lasts
                    expert.release()
                served += 1
                peak = max(peak, proc.memory_info().rss)
                time.sleep(0.05)
            sent, connections = map(int, flooder.stdout.read().split())
        finally:
            flooder.kill()
            flooder.wait()
        assert sent > 200_000, f"the flooder sent only {sent} messages: not a flood on this machine"
        assert served >= 10
        stats = wait_stats(daemon.endpoint, lambda s: True)
        grown_mib = (peak - rss_start) / 2**20
        print(f"RSS {rss_start / 2**20:.0f} -> peak {peak / 2**20:.0f} MiB; {sent} messages over {connections} "
              f"connections; {stats['counters'].get('floods_cut')} cuts; {served} fetches served meanwhile")
        assert stats["counters"]["floods_cut"] >= 1, (sent, connections, stats["counters"])
        bound_mib = (FLOOD_GROWTH_BYTES >> 20) + 64  # what grows until the cut, and a batch more
        assert grown_mib < bound_mib, f"RSS grew {grown_mib:.0f} MiB under a flood of {sent} messages"
        for expert in client.fetch([(3, 15)]):
            expert.release()
    assert f"connection(s) of pid {flooder.pid}: it sent" in daemon.log


def test_stats_beyond_the_budget_get_busy(daemon: Daemon) -> None:
    """STATS answers are kilobytes: a peer asking faster than MAX_STATS_PER_S a second gets ERROR
    BUSY (a hundred bytes) for the rest, so that what waits for a peer that does not read stays small."""
    from expertpack.client import protocol as p
    from expertpack.daemon.flood import MAX_STATS_PER_S

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(daemon.endpoint)
        started = time.monotonic()
        for _ in range(5 * MAX_STATS_PER_S):
            s.send(p.encode(p.Stats()))
        replies = []
        while len(replies) < 5 * MAX_STATS_PER_S and s.poll(10_000):
            replies.append(p.decode(s.recv()))
        took_s = time.monotonic() - started
    finally:
        ctx.destroy(linger=0)
    answered = sum(isinstance(r, p.StatsReply) for r in replies)
    busy = [r for r in replies if isinstance(r, p.Error) and r.code is p.ErrorCode.BUSY]
    assert len(replies) == 5 * MAX_STATS_PER_S
    assert answered + len(busy) == len(replies)
    assert answered <= MAX_STATS_PER_S * (int(took_s) + 2), (answered, took_s)
    assert busy and "STATS a second" in busy[0].message


def test_the_guard_names_the_top_sender_only_when_the_heap_grows() -> None:
    """Saturation alone is full load (clients that wait for their answers); only growth of the
    heap during it names a flooder."""
    from expertpack.daemon.flood import FloodGuard

    guard = FloodGuard(growth_bytes=100, min_messages=10)
    assert guard.after_batch(1000) is None  # saturation begins
    for _ in range(30):
        guard.seen(7)
    guard.seen(8)
    assert guard.after_batch(1050) is None  # saturated, not grown enough
    assert guard.after_batch(None) is None  # a break: counting starts over
    assert guard.after_batch(5000) is None
    for _ in range(30):
        guard.seen(8)
    for _ in range(40):
        assert guard.after_batch(5000) is None  # saturated for long, nothing grows: full load
    flooder = guard.after_batch(5100)
    assert flooder is not None and flooder.peer == 8 and flooder.messages == 30
    assert guard.after_batch(5250) is None  # nobody sent since the last cut
