"""The VRAM expert cache fed by expertd, an ExpertSource like any other: one device allocation of
`slot_count` slots of one expert block each. `load(layer, experts)` serves hits from their slots;
misses get victims (CachePolicy: LFU, LRU among equals, never this step's experts), are fetched from
the daemon in one request, and as each arrives its bytes are copied from the shared staging into its
cache slot on a copy stream; the compute stream waits on each slot's event, and each staging slot is
released once its copy is done (polled, not waited for, unless the client runs out of staging).
On the CPU the same code runs with plain copies, so CI tests the policy and the protocol.
Read-only: eviction never writes back.
Prefetch (prefetch.py): `prefetch(layer, experts)` sends the keys a later layer is predicted to
miss ahead of it, `ahead(layer)` says which later layers this cache may prefetch for, and
`layer_done(layer)` cancels what a layer was predicted but did not use. A miss that a prefetch
brought is copied in from where it waits, with no second read; the policy and the slots are the
same either way, so prefetch changes when bytes arrive, never which.
Kept RAM-tier blocks (protocol v8): a miss expertd answers from its RAM tier is copied in as any
other, and its hold is then kept (KEEP) rather than released, up to the session's ram_keeps: when
the policy later evicts that expert from its VRAM slot, the device table points at the block in
the tier (host memory the worker registered with CUDA, read by the GPU at its address) instead of
marking it absent. A step whose experts are all in VRAM or kept needs nothing of expertd: a table
step (engine.TableDecode) copies the kept ones into its transit slots on the device
(ops.expert_lookup), a segmented step's kernels read them where they lie, and only the torch path
(`load`) copies them into a slot first. Kept holds end the oldest one in VRAM first (insurance
only), else the least used; they end once every step that may read them has run."""

from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Sequence

import torch

from expertpack.client import ClientError, Expert, ExpertClient, release_all
from expertpack.client.protocol import prefetch_budget
from expertpack.packtools.layout import ALIGNMENT, ExpertKey, LayerLayout, Manifest

from ..weights.model_files import block_views
from .cache_policy import CachePolicy, CacheTooSmall, slot_count
from .daemon_link import DaemonLink
from .source import ExpertRows, ExpertWeights

log = logging.getLogger("expert-worker")


AHEAD_TRANSIT = 3  # a table step's slots past the cache's, in steps' k: transit, then two sets ahead


def slot_bytes(manifest: Manifest) -> int:
    """One cache slot: the largest expert block, rounded up to the pack's alignment so that slots
    start where blocks start on disk and every role keeps its alignment (typed views, DMA)."""
    return -(-max(l.payload_bytes for l in manifest.layers) // ALIGNMENT) * ALIGNMENT


OWED_STEPS = 256  # table steps whose touches wait for the policy's next use, at most
RING_STEPS = 32  # decode steps whose records wait on the device (found_on_device), at most, per record shape
AfterSend = Callable[[], None]  # what a step sends once its own misses are asked for (prefetches)


def _once(fn: AfterSend | None) -> AfterSend | None:
    """`fn`, run at most once however often it is called (a reconnect sends a request again)."""
    if fn is None:
        return None
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return run


def _tier_slot(expert: Expert) -> bool:
    """Whether expertd delivered `expert` in a RAM tier slot (a hold it may keep), not in staging."""
    welcome = expert.client.welcome
    return welcome.ram_first_slot <= expert.slot < welcome.ram_first_slot + welcome.ram_slots


class CacheError(RuntimeError):
    """The daemon answered with something this cache did not ask for."""


@dataclass
class CacheCounters:
    hits: int = 0  # unique keys found resident, per step
    misses: int = 0  # unique keys fetched, per step
    kept_hits: int = 0  # unique keys found in kept RAM-tier blocks (read over PCIe, expertd not asked), per step
    evictions: int = 0
    h2d_bytes: int = 0
    stall_s: float = 0.0  # time load() spent waiting for misses
    steps: int = 0
    prefetch_issued: int = 0  # keys sent ahead of their layer
    prefetch_used: int = 0  # misses a prefetch brought (recall: of misses; precision: of issued)
    prefetch_stale: int = 0  # prefetches cancelled because their layer ran without them

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """What happened after `before` (a snapshot): the per-request view of cumulative counters."""
        return {k: v - before[k] for k, v in self.snapshot().items()}


def prefetch_rates(counters: dict[str, float]) -> dict[str, float]:
    """Prefetch precision (of the keys sent ahead, the share their layer used) and recall (of the
    misses, the share a prefetch had brought), from CacheCounters values (a snapshot, or a
    difference of two); 0 where nothing was sent or missed."""
    issued, used, misses = counters["prefetch_issued"], counters["prefetch_used"], counters["misses"]
    return {"prefetch_precision": used / issued if issued else 0.0, "prefetch_recall": used / misses if misses else 0.0}


@dataclass
class CopyRecord:
    """One miss on its way in, for a timeline (recorded when `ExpertCache.timeline` is a list):
    host times (perf_counter seconds) of its READY and of the copy call's return, whether the copy
    was still running when the call returned (true async DMA), and when the device finished it."""
    fetch: int  # which miss request of the run
    key: ExpertKey
    arrived_s: float
    issued_s: float
    running_at_issue: bool
    _done: "torch.cuda.Event | None" = None
    _ref: "tuple[torch.cuda.Event, float] | None" = None  # an event and the host time it completed

    @property
    def done_s(self) -> float:
        if self._done is None:
            return self.issued_s  # a synchronous copy (CPU)
        ref_event, ref_host = self._ref
        self._done.synchronize()
        return ref_host + ref_event.elapsed_time(self._done) / 1000


@dataclass
class _Ring:
    """Records of decode steps owed to the counters (ExpertCache.found_on_device): the first `count`
    of `records` [RING_STEPS, 2, served layers, pairs], on the device."""

    records: torch.Tensor
    count: int = 0


@dataclass
class _Pending:
    event: "torch.cuda.Event | None"  # None: a CPU copy, done when issued
    expert: Expert

    def done(self) -> bool:
        return self.event is None or self.event.query()


class ExpertCache:
    def __init__(self, manifest: Manifest, link: DaemonLink, device: torch.device, cache_bytes: int,
                 reserve_bytes: int = 0, layers: Collection[int] | None = None,
                 pending: "deque[_Pending] | None" = None) -> None:
        """`layers`: the MoE layers this cache serves (default all; a worker spanning devices has
        one cache per device, split_experts.py); `pending`: the queue of staging slots whose copy may
        still run, shared by the caches of one DaemonLink (the link's staging leases are theirs together)."""
        self.manifest = manifest
        self.link = link
        self.device = device
        self.layers = {l.layer: l for l in manifest.layers}
        self.slot_bytes = slot_bytes(manifest)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else cache_bytes + reserve_bytes
        self.served = sorted(self.layers if layers is None else layers)
        every_expert = len(self.served) * manifest.model.n_expert  # no use for more slots than that
        self.n_slots = min(every_expert, slot_count(cache_bytes, free, reserve_bytes, self.slot_bytes,
                                                    manifest.model.n_expert_used))
        # The device reads host memory at its address only where the staging is registered with CUDA.
        self._may_keep = device.type == "cpu" or link.pinned
        # A cache with a slot for every expert it serves never evicts (victims are empty slots first):
        # its policy's touches change nothing it does, and owed steps pay only their counters.
        self._evicts = self.n_slots < every_expert
        # After the slots, a decode step's transit slots: where a table step copies the kept blocks it
        # reads; and where it may keep blocks and evict, the two sets of ahead slots it copies the next
        # layer's guessed kept blocks into (engine.TableDecode): 3k slots beside the cache's (64 MB for
        # Qwen3-30B-A3B's Q4_K experts), out of the device's reserve.
        self.slots_end = self.n_slots * self.slot_bytes
        k = manifest.model.n_expert_used
        self.n_transit = AHEAD_TRANSIT * k if self._may_keep and self._evicts else k
        self.memory = torch.empty(self.slots_end + self.n_transit * self.slot_bytes, dtype=torch.uint8, device=device)
        # Kept pairs table steps looked up with a guess ahead, of those read from the ahead slots, and
        # the blocks copied ahead (ops.expert_lookup adds to it on the device: read_ahead() says)
        self.ahead_counts = torch.zeros(3, dtype=torch.int64, device=device)
        self.policy = CachePolicy(self.n_slots)
        self._counters = CacheCounters()
        # Where each expert sits now, for steps that look their experts up on the device
        # (engine.TableDecode): the byte offset of (layer, expert) from `memory`: in [0, slots_end) in
        # its slot, -1 where it is absent, elsewhere in the RAM tier (a kept block: `kept`).
        self.table = torch.full((max(self.layers) + 1, manifest.model.n_expert), -1, dtype=torch.int64, device=device)
        self._owed: list[tuple[list[list[int]], list[list[int]]]] = []  # table steps' experts and offsets, owed
        self._rings: dict[torch.Size, _Ring] = {}  # owed steps' records on the device, by shape (found_on_device)
        # The generation thread owes steps and pays them; /metrics reads the counters from another (stats).
        self._owing = threading.RLock()
        self.kept: dict[ExpertKey, Expert] = {}  # kept RAM-tier blocks, the oldest kept first
        self.keep_share = 1.0  # of the session's ram_keeps (a worker spanning devices splits it between its caches)
        if not self._may_keep:
            log.warning("the staging is not registered with CUDA: RAM-tier experts are copied in at each miss, "
                        "never read where they lie")
        self._unkept: list[Expert] = []  # kept holds ended during a fetch, released once no step reads them
        self._ending: list[Expert] = []  # kept holds ended, their RELEASE maybe not sent yet
        self.ready: dict[int, torch.cuda.Event] = {}  # slot -> event its last copy recorded
        self._pending: deque[_Pending] = deque() if pending is None else pending  # staging slots whose copy may still run
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.timeline: list[CopyRecord] | None = None  # set to [] to record every miss (tests, benchmarks)
        self._fetches = 0
        self._ref: tuple[torch.cuda.Event, float] | None = None

    @property
    def counters(self) -> CacheCounters:
        self._settle()
        return self._counters

    @property
    def holds_every_expert(self) -> bool:
        """Whether every expert the cache serves sits in a VRAM slot now (after fill(), where the
        slots hold them all): then no step's experts can be absent, however many it picks."""
        return not self._evicts and len(self.policy.slot_of) == self.n_slots

    @property
    def fetches(self) -> int:
        """How many times a step has waited for misses: unchanged over a step, it found every expert."""
        return self._fetches

    @property
    def capacity(self) -> int:
        """The most experts one load() can hand out at once (ExpertFFN splits larger steps)."""
        return self.n_slots

    @property
    def resident_bytes(self) -> int:
        return len(self.policy.slot_of) * self.slot_bytes

    def layout(self, layer: int) -> LayerLayout:
        return self.layers[layer]

    def load(self, layer: int, experts: Sequence[int], then: AfterSend | None = None) -> dict[int, ExpertWeights]:
        """`experts` as weights where they lie: in their slots, or kept in the RAM tier on the CPU
        (on a GPU the torch path copies a kept one into a slot first); `then`: see waves."""
        offsets = self._acquire(layer, experts, then, in_place=self.device.type == "cpu")
        layout, staging = self.layers[layer], self.link.staging
        return {e: block_views(layout, self.memory, at) if 0 <= at < self.slots_end
                else block_views(layout, staging, at + self.memory.data_ptr() - staging.data_ptr())
                for e, at in zip(experts, offsets)}

    def expert_rows(self, layer: int, ids: torch.Tensor, then: AfterSend | None = None) -> Iterator[ExpertRows]:
        """The step's experts in waves the cache can hold (one, unless the step selected more
        experts than there are slots): one host sync for the step's unique ids, one upload of the
        expert -> slot map per wave. `then`: see waves."""
        for offsets, pairs in self.waves(layer, ids.reshape(-1).tolist(), then):
            yield ExpertRows(self.memory, torch.tensor(offsets, dtype=torch.int64).to(self.device),
                             None if pairs is None else torch.tensor(pairs, dtype=torch.int32).to(self.device))

    def waves(self, layer: int, chosen: list[int], then: AfterSend | None = None
              ) -> Iterator[tuple[list[int], list[int] | None]]:
        """The host side of expert_rows, for the experts `chosen` [T*k] by a step's pairs: per wave,
        each pair's byte offset into `memory` (pairs of other waves point at slot 0 and are not
        run) and the pairs it runs (None: all of them), its slots acquired when the iteration
        reaches it (after the previous wave's compute was enqueued). A segmented decode step
        (engine.SegmentedDecode) takes the one wave of a step from here and uploads the offsets
        itself, into the buffer its graphs read. `then` (the later layers' prefetches) runs once,
        as soon as the first wave's misses are asked for (at once when it has none): expertd's idle
        readers then start on what the model waits for, not on what it may need later."""
        unique = sorted(set(chosen))
        # The layer's routing is known: what was prefetched for it and not chosen is stale now, and its
        # reads not yet started never compete with this step's.
        self._counters.prefetch_stale += self.link.ahead.cancel(layer, keep=unique)
        for start in range(0, len(unique), self.n_slots):
            wave = unique[start:start + self.n_slots]
            at = dict(zip(wave, self._acquire(layer, wave, then)))
            then = None
            offsets = [at.get(e, 0) for e in chosen]  # [T*k]
            pairs = None if len(wave) == len(unique) else [p for p, e in enumerate(chosen) if e in at]
            yield offsets, pairs

    def _acquire(self, layer: int, experts: Sequence[int], then: AfterSend | None = None, in_place: bool = True
                 ) -> list[int]:
        """The byte offsets (from `memory`) of `experts`, fetching what is missing (`then` run once
        that is asked for, or at once); the compute stream waits for their copies. A kept expert
        is read where it lies, or with `in_place` false copied into a slot first."""
        self.check_session()
        keys = [ExpertKey(layer, e) for e in experts]
        if len(keys) > self.n_slots:
            raise CacheTooSmall(f"{len(keys)} experts requested at once, the cache holds {self.n_slots}")
        self._settle()
        self.policy.touch(keys)
        self._counters.steps += 1
        absent = [k for k in keys if k not in self.policy.slot_of]
        kept = [k for k in absent if k in self.kept]
        self._counters.hits += len(keys) - len(absent)
        self._counters.kept_hits += len(kept)
        if in_place:
            absent = [k for k in absent if k not in self.kept]
        if absent:
            self._fetch(absent, protected=set(keys), then=then)
        elif then is not None:
            then()
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        offsets = []
        for key in keys:
            slot = self.policy.slot_of.get(key)
            if slot is None:
                offsets.append(self._tier_offset(self.kept[key]))
                continue
            if compute is not None and slot in self.ready:
                compute.wait_event(self.ready[slot])
            offsets.append(slot * self.slot_bytes)
        return offsets

    # ---- steps run from the device table ----------------------------------------------------
    def found(self, chosen: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]]) -> None:
        """A step found every expert it chose in the table (engine.TableDecode): `chosen[i]` the
        experts [T*k] of served layer i, `offsets[i]` where it found them. What `_acquire` does for
        a step without misses (the policy's touch, the counters) is owed until the cache next needs
        the policy or its counters, then done in order: the same policy and counters as when each
        step is acquired, with no Python per layer on the token's path."""
        with self._owing:
            self._owed.append(([list(c) for c in chosen], [list(o) for o in offsets]))
            if len(self._owed) >= OWED_STEPS:
                self._settle()

    def found_on_device(self, record: torch.Tensor) -> None:
        """found() for a step whose record (TableDecode.record: [2, served layers, pairs], ids then
        offsets) is still on the device, where the cache holds every expert (so no step can miss,
        and none evicts: only the counters are owed, in any order). The record is copied on the
        device into a ring of owed records, behind the step, and read with one copy to the host
        when the owed steps are paid: the step waits for nothing (the sync and the host's Python
        after each step made a 12-layer token 8% slower than resident; a pinned host buffer a
        step, copied into asynchronously, made it 21% slower: H100)."""
        with self._owing:
            ring = self._rings.get(record.shape)
            if ring is None:
                ring = self._rings[record.shape] = _Ring(torch.empty((RING_STEPS, *record.shape), dtype=record.dtype,
                                                                     device=record.device))
            ring.records[ring.count].copy_(record)
            ring.count += 1
            if ring.count == RING_STEPS:
                self._settle()

    def _settle(self) -> None:
        """Pays the owed steps. The touches cost ~0.3 ms a 12-layer token on the dev VM, a quarter
        of the step they follow: only a cache that can evict pays them."""
        with self._owing:
            self._pay()

    def _pay(self) -> None:
        owed = self._owed
        for ring in self._rings.values():  # steps that could not miss: their order does not matter
            owed += [(record[0], record[1]) for record in ring.records[:ring.count].tolist()]
            ring.count = 0
        for chosen, offsets in owed:
            for layer, experts, at in zip(self.served, chosen, offsets):
                unique = sorted(set(experts))  # as waves() acquires them
                if self._evicts:
                    self.policy.touch([ExpertKey(layer, e) for e in unique])
                kept = len({e for e, o in zip(experts, at) if not 0 <= o < self.slots_end})
                self._counters.steps += 1
                self._counters.hits += len(unique) - kept
                self._counters.kept_hits += kept
        self._owed.clear()

    def _set_table(self, entries: list[tuple[ExpertKey, int]]) -> None:
        """New table entries (offsets, or -1): on the compute stream, behind the copies the step
        waits for, ahead of any step reading it, with no host sync."""
        if not entries:
            return
        pinned = self.device.type == "cuda"  # an asynchronous copy: no host sync in a fetch
        rows, cols, values = torch.tensor([(k.layer, k.expert, at) for k, at in entries], dtype=torch.int64,
                                          pin_memory=pinned).T.contiguous().to(self.device, non_blocking=pinned)
        self.table.index_put_((rows, cols), values)

    # ---- kept RAM-tier blocks ------------------------------------------------------------------
    @property
    def keep_budget(self) -> int:
        """How many RAM-tier blocks this cache may keep now (0 without a session or a CUDA-registered staging)."""
        client = self.link.client
        return int(client.ram_keeps * self.keep_share) if self._may_keep and client is not None else 0

    def _tier_offset(self, expert: Expert) -> int:
        """Where a kept block lies, as an offset from `memory` (the device reads host memory at its address)."""
        assert self.link.staging is not None
        return self.link.staging.data_ptr() + expert.slot * self.link.slot_bytes - self.memory.data_ptr()

    def check_session(self) -> None:
        """Kept holds die with their session (a daemon restart, or this process stopped past the
        heartbeat timeout: expertd may have reused their blocks): their table entries go absent,
        and those kept since over a new session end too (the oldest kept is the first to be gone).
        Before any step that may read them (engine.TableDecode asks before each replay)."""
        oldest = next(iter(self.kept.values()), None)
        if oldest is not None and oldest.client is self.link.client:
            self._drop_condemned(oldest.client)
        if oldest is not None and (oldest.client is not self.link.client or oldest.client.silenced()):
            gone = [(k, -1) for k in self.kept if k not in self.policy.slot_of]
            self._unkept.extend(e for e in self.kept.values() if e.client is self.link.client)
            self.kept.clear()
            self._set_table(gone)
            self._release_unkept()

    def _drop_condemned(self, client: ExpertClient) -> None:
        """Reads what expertd sent by now (no wait); kept blocks it condemned (CONDEMNED: they failed
        its scrub) are read no more: their table entries go absent, their holds end. A copy in a
        VRAM slot stays: it was made when expertd named the block."""
        with self.link._lock:
            try:
                client.pump()
            except ClientError as exc:  # the session is gone: check_session and the next fetch see to it
                log.debug("reading expertd's messages: %s", exc)
            condemned, client.condemned = client.condemned, set()
        if not condemned:
            return
        keys = [k for k, e in self.kept.items() if e.client is client and e.slot in condemned]
        log.error("expertd found %d RAM-tier blocks this worker keeps altered in memory (its scrub): reading them "
                  "no more, fetching them again when needed", len(keys))
        self._unkept.extend(self.kept.pop(k) for k in keys)
        self._release_unkept()

    def _keep(self, expert: Expert) -> bool:
        """Keeps `expert`'s hold if the budget has room now (kept holds being ended still count:
        expertd counts them until their RELEASE)."""
        self._ending = [e for e in self._ending if not e.released]
        if len(self.kept) + len(self._ending) >= self.keep_budget:
            return False
        self.kept[expert.key] = expert
        expert.client.keep([expert])
        return True

    def _keep_target(self) -> int:
        """The kept holds a fetch leaves: a sixteenth of the budget stays free for the next ones."""
        budget = self.keep_budget
        return budget - max(1, budget // 16) if budget else 0

    def _trim_kept(self, protected: set[ExpertKey]) -> None:
        """After a fetch, ends kept holds until a sixteenth of the budget is free for the next
        fetches' keeps: first the oldest whose expert is in a slot (insurance only), then the least
        used not in this step."""
        excess = len(self.kept) - self._keep_target()
        if excess <= 0:
            return
        victims = [k for k in self.kept if k in self.policy.slot_of][:excess]
        if len(victims) < excess:
            score = self.policy.frequency.score
            victims += heapq.nsmallest(excess - len(victims),
                                       (k for k in self.kept if k not in self.policy.slot_of and k not in protected),
                                       key=lambda k: score.get(k, float("-inf")))
        self._unkept.extend(self.kept.pop(k) for k in victims)

    def _release_unkept(self) -> None:
        """Releases the kept holds ended during a fetch (their table entries already changed, on the
        compute stream): once every step enqueued until now, which may read them, has run."""
        if not self._unkept:
            return
        self._set_table([(e.key, -1) for e in self._unkept if e.key not in self.policy.slot_of])
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._pending.extend(_Pending(event, expert) for expert in self._unkept)
        self._ending += self._unkept
        self._unkept = []

    def fill(self) -> int:
        """Where the VRAM slots and the keep budget hold every expert this cache serves (the model
        fits VRAM and expertd's RAM tier), reads each one not present once, layer by layer, as a
        worker starts: what llama.cpp's first pass over its mapped file does, after which every
        step finds its experts (in a slot, or kept in the tier) and runs from the table. The policy
        is not touched (a fill is no step). Returns how many experts it fetched (0: the model does
        not fit, or nothing was absent)."""
        n_expert = self.manifest.model.n_expert
        if self.n_slots + self._keep_target() < len(self.served) * n_expert:
            return 0
        start, fetched = time.perf_counter(), 0
        # Fetches no larger than the keep budget's free part (_keep_target), so that no key of one
        # is refused a keep; rounds until nothing is absent (a key evicted before it was kept).
        chunk = max(1, min(self.n_slots // 2, self.keep_budget - self._keep_target()))
        for _ in range(4):
            absent = [k for k in (ExpertKey(l, e) for l in self.served for e in range(n_expert))
                      if k not in self.policy.slot_of and k not in self.kept]
            if not absent:
                break
            for at in range(0, len(absent), chunk):
                part = [k for k in absent[at:at + chunk] if k not in self.policy.slot_of and k not in self.kept]
                for layer in sorted({k.layer for k in part}):  # the cache fetches one layer's keys at a time
                    keys = [k for k in part if k.layer == layer]
                    self._fetch(keys, protected=set(keys))
                    fetched += len(keys)
        present = sum(1 for l in self.served for e in range(n_expert)
                      if ExpertKey(l, e) in self.policy.slot_of or ExpertKey(l, e) in self.kept)
        log.info("read %d experts once in %.1f s: %d of %d now in VRAM or kept in expertd's RAM tier", fetched,
                 time.perf_counter() - start, present, len(self.served) * n_expert)
        return fetched

    # ---- prefetch ------------------------------------------------------------------------------
    def ahead(self, layer: int, depth: int) -> tuple[int, ...]:
        """The next `depth` MoE layers after `layer` that this cache serves, in order: what may be
        prefetched while `layer` runs (none past this cache's range: another device's cache)."""
        if layer not in self.served:
            return ()
        at = self.served.index(layer) + 1
        return tuple(self.served[at:at + depth])

    def prefetch(self, layer: int, experts: Sequence[int], running: int | None = None) -> None:
        """Sends the keys of `experts` (most wanted first) that are not resident ahead of `layer`'s
        step, as far as the staging the prefetches may hold allows (those of the `running` layer,
        taken or cancelled next, not counted)."""
        keys = [ExpertKey(layer, e) for e in experts]
        self._counters.prefetch_issued += self.link.ahead.submit(
            (k for k in keys if k not in self.policy.slot_of and k not in self.kept), running)

    def layer_done(self, layer: int) -> None:
        """`layer`'s step has run: its prefetches it did not take are stale, cancelled now."""
        self._counters.prefetch_stale += self.link.ahead.cancel(layer)

    # ---- misses --------------------------------------------------------------------------------
    def _fetch(self, misses: list[ExpertKey], protected: set[ExpertKey], then: AfterSend | None = None) -> None:
        """Puts `misses` into slots: kept ones copied from where they lie, the others asked of expertd."""
        start = time.perf_counter()
        # Prefetches sent since the last fetch may hold slots: before waiting for expertd, copies
        # still in flight leave it one for each key it must still answer (see _release_finished).
        self._release_finished(keep_free=1)
        victims = self.policy.victims(len(misses), protected)
        asked = [k for k in misses if k not in self.kept]
        self._counters.misses += len(asked)
        self._fetches += bool(asked)
        if self.timeline is not None and self.copy_stream is not None:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self.copy_stream)
            ref.synchronize()
            self._ref = (ref, time.perf_counter())
        free_slots = list(victims)
        table: list[tuple[ExpertKey, int]] = []

        def place(key: ExpertKey, slot: int) -> None:
            """The policy's and the table's record of `key` in `slot` (its copy issued)."""
            old = self.policy.place(slot, key)
            self._counters.evictions += old is not None
            if old is not None:
                table.append((old, self._tier_offset(self.kept[old]) if old in self.kept else -1))
            table.append((key, slot * self.slot_bytes))

        if not asked and then is not None:
            then()
        with self._copying():
            doubtful: list[ExpertKey] = []
            for key in misses:
                if key in self.kept:
                    slot = free_slots.pop()
                    self._copy_in(self.kept[key], slot, time.perf_counter(), release=False)
                    place(key, slot)
                    if self.kept[key].client.silenced():
                        doubtful.append(key)
            wanted = set(asked)
            # once: a reconnect sends the demand again, the prefetches went with the first send
            for expert, prefetched in (self.link.ahead.fetch(asked, on_sent=self._on_compute_stream(_once(then)))
                                       if asked else ()):
                self._counters.prefetch_used += prefetched
                self._check_delivery(expert, wanted)
                slot = free_slots.pop()
                arrived = time.perf_counter()
                kept = _tier_slot(expert) and not expert.client.silenced() and self._keep(expert)
                self._copy_in(expert, slot, arrived, release=not kept)  # the slot holds the expert once its copy is issued
                place(expert.key, slot)
                if expert.client.silenced():  # a kept one goes with its session (check_session)
                    doubtful.append(expert.key)
                self._release_finished(keep_free=1)
            while doubtful:  # copied after the session lapsed: read again, over a new session, into the same slots
                log.warning("this worker was stopped past expertd's heartbeat timeout while copying %d experts out "
                            "of staging: reading them again", len(doubtful))
                keys, doubtful = doubtful, []
                wanted = set(keys)
                self.link.refetched += len(keys)
                for expert, _ in self.link.ahead.fetch(keys):
                    self._check_delivery(expert, wanted)
                    self._copy_in(expert, self.policy.slot_of[expert.key], time.perf_counter())
                    if expert.client.silenced():
                        doubtful.append(expert.key)
                    self._release_finished(keep_free=1)
        self._set_table(table)
        self._trim_kept(protected)
        self._release_unkept()
        self._release_finished(keep_free=0, wait=self.device.type != "cuda")
        self.check_session()  # a reconnect during the fetch ended the old session's kept holds
        self._counters.stall_s += time.perf_counter() - start

    def _on_compute_stream(self, fn: AfterSend | None) -> AfterSend | None:
        """`fn` run on the stream current now (the compute stream) even when called from inside
        `_copying`: the lookahead's router work must not queue the copies behind it."""
        if fn is None or self.copy_stream is None:
            return fn
        compute = torch.cuda.current_stream(self.device)

        def run() -> None:
            with torch.cuda.stream(compute):
                fn()
        return run

    def _check_delivery(self, expert: Expert, wanted: set[ExpertKey]) -> None:
        """An expert this request asked for (once) and in its block's size, or CacheError."""
        if expert.key not in wanted or expert.nbytes != self.layers[expert.key.layer].payload_bytes:
            expert.release()
            raise CacheError(f"expertd delivered {expert!r}, which this request did not ask for, or not in "
                             f"that size; nothing of it was used")
        wanted.discard(expert.key)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Where one fetch's copies are issued: on the copy stream, made current once for all of
        them, after it waited once for the compute stream (every reader of a victim slot was
        enqueued before the fetch began, and none is while it runs). Done per key, the stream switch
        and the wait were most of a miss's copy-issuing host time (bench/profile_streaming.py)."""
        if self.copy_stream is None:
            yield
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            yield

    def _copy_in(self, expert: Expert, slot: int, arrived: float, release: bool = True) -> None:
        """Issues the copy of `expert` into `slot` (inside `_copying`); on the CPU, copies it. Its
        staging slot or hold is given back once the copy is done, unless `release` is false (kept)."""
        dst = self.memory[slot * self.slot_bytes: slot * self.slot_bytes + expert.nbytes]
        self._counters.h2d_bytes += expert.nbytes
        if self.copy_stream is None:
            dst.copy_(torch.frombuffer(expert.data, dtype=torch.uint8))
            if release:
                self._pending.append(_Pending(None, expert))  # given back by the next _release_finished
            if self.timeline is not None:
                self.timeline.append(CopyRecord(self._fetches, expert.key, arrived, time.perf_counter(), False))
            return
        staging = self.link.staging
        assert staging is not None
        base = expert.slot * self.link.slot_bytes
        src = staging[base: base + expert.nbytes]
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(enable_timing=self.timeline is not None)
        event.record(self.copy_stream)
        if self.timeline is not None:
            self.timeline.append(CopyRecord(self._fetches, expert.key, arrived, time.perf_counter(),
                                            not event.query(), event, self._ref))
        self.ready[slot] = event
        if release:
            self._pending.append(_Pending(event, expert))

    def _release_finished(self, keep_free: int, wait: bool = False) -> None:
        """Gives back staging slots (or RAM tier holds) whose copy is done. If the client has fewer
        than `keep_free` staging slots left for the rest of the fetch (those prefetches may hold do
        not count: at most their budget of the staging, which expertd keeps them to, whatever they
        hold in its RAM tier, where the demand's share is at least as large), waits for the oldest
        copy."""
        if self._pending and self._pending[0].expert.client is not self.link.client:
            # The daemon went away and the link reconnected: it synchronized the device before
            # unmapping, so those copies are complete, and their leases died with the old session.
            kept = [p for p in self._pending if p.expert.client is self.link.client]
            self._pending.clear()  # in place: other caches of the link may share the queue
            self._pending.extend(kept)
        done: list[Expert] = []  # given back together: one RELEASE
        while self._pending and self._pending[0].done():
            done.append(self._pending.popleft().expert)
        while self._pending and len(self._pending) > self._copy_room(keep_free):
            oldest = self._pending.popleft()
            if oldest.event is not None:
                oldest.event.synchronize()
            done.append(oldest.expert)
        if wait:
            while self._pending:
                done.append(self._pending.popleft().expert)
        if done:
            release_all(done)

    def _copy_room(self, keep_free: int) -> int:
        """How many copies may still hold staging slots (only asked while some do: the link has a
        session then)."""
        n_slots = self.link.n_staging_slots
        return n_slots - keep_free - min(self.link.ahead.held, prefetch_budget(n_slots))

    def read_ahead(self) -> dict[str, int]:
        """What table steps copied ahead so far (engine.TableDecode): the kept pairs of layers
        looked up after a guess, those read from an ahead slot, and the blocks copied ahead. Reads
        the device (a sync): for benchmarks and tests, never the token's path."""
        kept, ahead, copied = self.ahead_counts.tolist()
        return {"kept_pairs": kept, "read_ahead": ahead, "copied_ahead": copied}

    def stats(self) -> dict:
        """The cache's cumulative counters and state, and the daemon's counters and RAM tier next to
        them (None while the daemon is unreachable)."""
        daemon = self.link.stats() or {}
        counters = self.counters.snapshot()
        return {"cache": {**counters, **prefetch_rates(counters), "slots": self.n_slots, "slot_bytes": self.slot_bytes,
                          "kept": len(self.kept), "keep_budget": self.keep_budget,
                          "resident_bytes": self.resident_bytes, "staging_pinned": self.link.pinned,
                          "reconnects": self.link.reconnects, "refetched": self.link.refetched},
                "daemon": daemon.get("counters"), "daemon_ram": daemon.get("ram")}

    def close(self) -> None:
        if self.copy_stream is not None:
            torch.cuda.synchronize(self.device)
        self._release_finished(keep_free=0, wait=True)
        release_all(e for e in self.kept.values() if e.client is self.link.client)
        self.kept.clear()
        self.link.close()
