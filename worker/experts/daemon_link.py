"""The worker's connection to expertd: fetches experts through the client library, reconnects when
the daemon goes away and fetches again what had not arrived (reads are idempotent), and gives up
with a clear error once the daemon has been gone `down_timeout_s`.

Recovery takes what the daemon's restart takes, not a timeout: the client notices a daemon that
exits (its BYE, or the connection closing, from a socket monitor) at once; the new HELLO is queued
on a fresh socket and answered as soon as a daemon binds the endpoint. A daemon that stays away
fails the request DaemonLost `down_timeout_s` after it was found gone (its HELLO waits no longer);
one that hangs with its connection open is found gone after `timeout_s` without an answer. A block
expertd read but found corrupt (FAIL CORRUPT) fails the request with CorruptExpert, naming the expert
and the pack: nothing is computed with it, and no retry can help. It also
exposes the shared staging segment as a tensor, registered with CUDA (cudaHostRegister, read-only:
the client maps it read-only, as only expertd writes it) when the worker runs on a GPU, so copies
out of it are true async DMA.

A ZeroMQ socket belongs to one thread at a time: every use of the client holds the link's lock.
stats() (for /health and /metrics, from any thread) asks the daemon now, on a socket of its own
that holds no session, so it never waits for a fetch in flight nor answers from memory: a daemon
that died during a generation reads as gone within the probe's timeout."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Callable, Iterator, Sequence

import torch
import zmq

from expertpack.client import ClientError, DaemonUnavailable, Expert, ExpertClient, FetchFailed
from expertpack.client import protocol as p
from expertpack.client.ipc import ipc_problem, may_connect
from expertpack.packtools.layout import ExpertKey

from .prefetch import Prefetches

log = logging.getLogger("expert-worker")

PROBE_TIMEOUT_S = 2.0  # how long /health and /metrics wait for the daemon's STATS
CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context
# cudaHostRegisterReadOnly: the device only reads the range; needed to pin a read-only mapping
CUDA_HOST_REGISTER_READ_ONLY = 0x08
RETRY_PAUSE_S = 0.05  # between a failed session and the next HELLO (which itself waits for a daemon)
START_PAUSE_MAX_S = 1.0  # the longest pause between two looks for a daemon that is not there at start


class DaemonLost(RuntimeError):
    """expertd stayed unreachable past the timeout; the request fails, nothing wrong was computed."""


class CorruptExpert(FetchFailed):
    """expertd read an expert's block and found it damaged (its crc32 does not match the pack's
    manifest): the request fails, nothing was computed with those bytes."""

    def __init__(self, failed: FetchFailed, endpoint: str, fingerprint: str) -> None:
        ClientError.__init__(self, f"expert (layer {failed.key.layer}, expert {failed.key.expert}) of pack "
                                   f"{fingerprint[:16]} (served by expertd at {endpoint}) is corrupt on disk; the "
                                   f"request fails and nothing was computed with it. expertd: {failed.message}")
        self.key = failed.key
        self.code = failed.code
        self.message = failed.message


class DaemonLink:
    def __init__(self, endpoint: str, fingerprint: str | None, pin_for: torch.device | Sequence[torch.device],
                 name: str = "expert-worker", timeout_s: float = 30.0, down_timeout_s: float = 60.0) -> None:
        """`pin_for`: the device, or every device, that copies out of the staging (a worker
        spanning several GPUs shares one link: the staging is registered once for all of them)."""
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self.pin_for = (pin_for,) if isinstance(pin_for, torch.device) else tuple(pin_for)
        self.name = name
        self.timeout_s = timeout_s
        self.down_timeout_s = down_timeout_s
        self.reconnects = 0
        # Keys asked of expertd again (an answer that failed, came too late or died with its
        # session, a session that lapsed while copying): expertd counted the first ask too, unless
        # it reached expertd on a session expertd had already ended.
        self.refetched = 0
        self.client: ExpertClient | None = None
        self.staging: torch.Tensor | None = None  # the whole segment, uint8
        self.pinned = False
        self._registered: int | None = None
        self._lock = threading.RLock()
        self._probe: zmq.Socket | None = None  # STATS only, no HELLO: never holds slots
        self._probe_lock = threading.Lock()
        self.ahead = Prefetches(self)  # experts fetched ahead of their layer, on this link's session
        deadline = time.monotonic() + timeout_s
        self._wait_for_socket(deadline)
        self._connect(timeout_s=max(deadline - time.monotonic(), RETRY_PAUSE_S))

    # ---- connection ---------------------------------------------------------------------------
    def _wait_for_socket(self, deadline: float) -> None:
        """At start, an ipc:// endpoint where nobody accepts yet (no socket file, or one a daemon
        that is gone left) is said at once and looked at again, with backoff, until `deadline`;
        a HELLO would wait there silently. A socket this user may not use is left to the client,
        which says so at once."""
        path = self.endpoint.removeprefix("ipc://")
        if not self.endpoint.startswith("ipc://") or not may_connect(path):
            return
        why = ipc_problem(self.endpoint)
        if why is None:
            return
        start = time.monotonic()
        log.warning("waiting for expertd at %s (%s)", self.endpoint,
                    "no socket yet" if not os.path.lexists(path) else "its socket refuses connections: the expertd "
                    "that made it is gone")
        pause_s = RETRY_PAUSE_S
        while why is not None:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise DaemonUnavailable(f"no expertd at {self.endpoint} after {time.monotonic() - start:.0f} s of "
                                        f"waiting (--daemon-timeout-s): {why}")
            time.sleep(min(pause_s, left_s))
            pause_s = min(2 * pause_s, START_PAUSE_MAX_S)
            why = ipc_problem(self.endpoint)
        log.info("expertd is up at %s after %.1f s", self.endpoint, time.monotonic() - start)

    def _connect(self, timeout_s: float | None = None) -> None:
        client = ExpertClient(self.endpoint, name=self.name, timeout_s=timeout_s or self.timeout_s,
                              expect_fingerprint=self.fingerprint)
        client.timeout_s = self.timeout_s
        self.client = client
        with warnings.catch_warnings():  # read-only by design: nothing here writes into it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.staging = torch.frombuffer(self.client.staging, dtype=torch.uint8)
        self.pinned = False
        if self.pin_for[0].type == "cuda":
            self._register()

    def _register(self) -> None:
        """Page-locks the shared segment for the GPU: copies from it become DMA, not staged. For
        several GPUs, once as portable memory: pinned in every device's context (a range can be
        registered once only)."""
        assert self.staging is not None
        ptr, size = self.staging.data_ptr(), self.staging.numel()
        flags = CUDA_HOST_REGISTER_READ_ONLY | (CUDA_HOST_REGISTER_PORTABLE if len(self.pin_for) > 1 else 0)
        with torch.cuda.device(self.pin_for[0]):
            err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)
        if int(err) != 0:
            log.warning("cudaHostRegister of the staging failed (%s); copies will be pageable and slower", err)
            return
        self._registered = ptr
        self.pinned = bool(self.staging.is_pinned())
        if not self.pinned:
            log.warning("the staging is registered but torch does not see it pinned; copies may be synchronous")

    def _disconnect(self) -> None:
        if self._registered is not None:
            for device in self.pin_for:
                torch.cuda.synchronize(device)  # no copy may still read the segment
            with torch.cuda.device(self.pin_for[0]):
                torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self.staging = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> None:
        with self._lock:
            if self.client is not None:  # cancelled prefetches' answers are in before the session ends
                self.ahead.cancel_all()
                self.ahead.settle()
            self._disconnect()
        with self._probe_lock:
            if self._probe is not None:
                self._probe.close(linger=0)
                self._probe = None

    def settle(self) -> None:
        """Waits until expertd has answered every cancelled prefetch and handled everything this
        worker sent (a PING's answer on the session's own connection comes after them), so that
        STATS, asked on another socket, counts all of it: for tools and tests that read the
        counters after a run."""
        with self._lock:
            if self.client is None:
                return
            self.ahead.settle()
            try:
                self.client.ping()
            except ClientError as exc:
                log.debug("settle: %s", exc)

    @property
    def slot_bytes(self) -> int:
        assert self.client is not None
        return self.client.welcome.slot_bytes

    @property
    def n_staging_slots(self) -> int:
        assert self.client is not None
        return len(self.client.slots)

    def stats(self) -> dict | None:
        """The daemon's STATS now, or None when it does not answer within PROBE_TIMEOUT_S. Safe from
        any thread; never waits for a fetch (the probe has its own socket and lock)."""
        timeout_s = min(PROBE_TIMEOUT_S, self.timeout_s)
        if not self._probe_lock.acquire(timeout=timeout_s):
            return None  # another thread's probe has been waiting that long: the daemon is not answering
        try:
            if self._probe is None:
                self._probe = zmq.Context.instance().socket(zmq.DEALER)
                self._probe.setsockopt(zmq.LINGER, 0)
                self._probe.connect(self.endpoint)
            self._probe.send(p.encode(p.Stats()))
            if self._probe.poll(int(timeout_s * 1000)):
                reply = p.decode(self._probe.recv())
                if isinstance(reply, p.StatsReply):
                    return reply.stats
            # No answer (a late one must not be taken for the next probe's) or not a STATS reply.
            self._probe.close(linger=0)
            self._probe = None
            return None
        except (zmq.ZMQError, p.ProtocolError) as exc:
            log.debug("stats probe: %s", exc)
            if self._probe is not None:
                self._probe.close(linger=0)
                self._probe = None
            return None
        finally:
            self._probe_lock.release()

    def other_pack(self, stats: dict) -> str | None:
        """What is wrong when expertd (its STATS reply) serves another pack than this worker's
        trunk was built with, or None: a daemon restarted on the endpoint with another pack
        answers every probe but refuses every session (HELLO: ERROR FINGERPRINT)."""
        theirs = stats.get("fingerprint")
        if self.fingerprint is None or theirs == self.fingerprint:
            return None
        return (f"expertd at {self.endpoint} serves pack {str(theirs)[:16]} ({stats.get('arch', '?')}), not pack "
                f"{self.fingerprint[:16]} this worker's trunk.gguf was built with; restart expertd on this worker's "
                "pack, or the worker on expertd's")

    def own_client(self, stats: dict | None) -> dict | None:
        """This worker's own line of a STATS reply's `clients` (its session's counters), found by
        its name and, where expertd knows it, its pid: None when the daemon did not answer or this
        worker holds no session now (between a daemon restart and its next request)."""
        if stats is None:
            return None
        pid = os.getpid()
        return next((c for c in stats.get("clients", ())
                     if c.get("name") == self.name and c.get("pid") in (pid, None)), None)

    # ---- fetching -----------------------------------------------------------------------------
    def fetch(self, keys: list[ExpertKey], on_sent: Callable[[], None] | None = None) -> Iterator[Expert]:
        """Every key, as it arrives; across reconnects if the daemon restarts meanwhile. The caller
        must release each expert (directly, or once a copy out of it has completed). `on_sent`
        runs once the request is sent, before the first wait, and again each time a reconnect
        sends it again (the expert cache runs its prefetches once: ExpertCache.waves)."""
        with self._lock:
            yield from self._fetch(keys, on_sent)

    def _fetch(self, keys: list[ExpertKey], on_sent: Callable[[], None] | None = None) -> Iterator[Expert]:
        remaining = list(keys)
        # When the daemon was found gone; None while it serves. No session at the start: an earlier
        # request found it gone, and this one waits for it no longer than down_timeout_s either.
        down_since: float | None = time.monotonic() if self.client is None else None
        asked = False  # whether `remaining` went out on a session: asked again, it is counted
        while remaining:
            if asked:
                self.refetched += len(remaining)
            asked = False
            try:
                if self.client is None:
                    self._reconnect(down_since)
                asked = True
                for expert in self.client.fetch(remaining, on_sent=on_sent):
                    remaining.remove(expert.key)
                    down_since = None
                    yield expert
                continue
            except FetchFailed as exc:
                if exc.code is p.FailCode.CORRUPT:
                    raise CorruptExpert(exc, self.endpoint, self.client.fingerprint if self.client else "?") from None
                if exc.code is not p.FailCode.SHUTDOWN:
                    raise
                lost: ClientError = DaemonUnavailable(f"expertd at {self.endpoint} is shutting down ({exc.message})")
            except DaemonUnavailable as exc:
                lost = exc
            # The daemon went away (a restart, mostly): a new session fetches what had not arrived.
            now = time.monotonic()
            down_since = down_since or now
            self._disconnect()
            if now - down_since >= self.down_timeout_s:
                raise DaemonLost(
                    f"expertd at {self.endpoint} has not answered for {self.down_timeout_s:g} s "
                    f"(--daemon-down-timeout-s): it went away and none came back; {len(remaining)} experts could "
                    f"not be fetched; last: {lost}. "
                    "Start expertd (systemctl start expertd); the worker keeps serving and reconnects at the "
                    "next request") from lost
            log.warning("expertd unavailable (%s); reconnecting for %d experts, for at most %.1f s more", lost,
                        len(remaining), down_since + self.down_timeout_s - now)
            time.sleep(RETRY_PAUSE_S)  # a daemon that refuses at once (shutting down) is not asked in a spin

    def _reconnect(self, down_since: float | None) -> None:
        """A new session; its HELLO waits for a daemon to come, but never past the down budget."""
        left_s = self.timeout_s if down_since is None else down_since + self.down_timeout_s - time.monotonic()
        if left_s <= 0:
            raise DaemonUnavailable(f"no expertd answered at {self.endpoint}")
        self._connect(timeout_s=min(self.timeout_s, left_s))
        self.reconnects += 1
        log.info("reconnected to expertd at %s%s", self.endpoint,
                 "" if down_since is None else f" after {time.monotonic() - down_since:.2f} s")
