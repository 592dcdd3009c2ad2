"""Experts fetched ahead of their layer, for one DaemonLink (issue 13): a key predicted for a later
layer is sent as its own one-key FETCH at PREFETCH priority (expertd reads every DEMAND key first),
and its answer waits in the client's staging slot, or in expertd's RAM tier where that admitted
it, until the layer runs. Then a key the layer needs is taken from there, without a second read
(waiting for it if its read is still on the way); a key it does not need is stale and cancelled,
so its slot comes back. Nothing here decides what is computed: the demand path asks for exactly
the keys the true routing selected, and only where their bytes come from changes.

Prefetches share the link's staging leases, or its holds on expertd's RAM tier where there is one
(protocol v6: WELCOME's ram_holds), with the demand fetches, so they never take more than `budget`
of them: every prefetch not yet taken or cancelled, and every cancelled one whose answer has not
arrived, may hold one. The rest stay for demand, which therefore always progresses; expertd keeps
the same half for demand of the staging slots and reads a prefetch that its tier does not admit
would take (it cannot be told here in advance).
The session the prefetches were sent on is the link's; after a reconnect they are forgotten (they
died with the old session) and demand fetches whatever they would have brought."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Iterator

from expertpack.client import ClientError, Expert, ExpertClient, Pending, Priority
from expertpack.client.protocol import prefetch_budget
from expertpack.packtools.layout import ExpertKey

if TYPE_CHECKING:
    from .daemon_link import DaemonLink

log = logging.getLogger("expert-worker")

SETTLE_TIMEOUT_S = 5.0  # at close, how long the answers of cancelled prefetches are waited for


def prefetch_share(client: ExpertClient) -> int:
    """What prefetches hold while they wait for their layer: RAM tier holds over a tier (expertd
    starts no more of them into staging than its half), else staging slots."""
    return client.welcome.ram_holds or len(client.slots)


class Prefetches:
    def __init__(self, link: "DaemonLink") -> None:
        self.link = link
        self.entries: dict[ExpertKey, Pending] = {}  # sent, not yet taken nor cancelled
        self._of_layer: dict[int, set[ExpertKey]] = {}  # the keys of `entries` by layer: asked every layer
        self.taken: list[Pending] = []  # taken by the demand fetch running, not yet handed to it
        self._session: ExpertClient | None = None

    # ---- accounting --------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Staging slots (or RAM tier holds) that prefetches may hold now."""
        client = self._live()
        if client is None:
            return 0
        return len(self.entries) + sum(pending.client is client for pending in self.taken) + client.abandoned

    def _live(self) -> ExpertClient | None:
        """The link's session; entries of an earlier one are dropped (they died with it)."""
        client = self.link.client
        if client is not self._session:
            self._clear()
            self._session = client
        return client

    def _pop(self, key: ExpertKey) -> Pending:
        keys = self._of_layer[key.layer]
        keys.discard(key)
        if not keys:
            del self._of_layer[key.layer]
        return self.entries.pop(key)

    def _clear(self) -> None:
        self.entries.clear()
        self._of_layer.clear()

    # ---- sending and cancelling --------------------------------------------------------------
    def submit(self, keys: Iterable[ExpertKey], running: int | None = None) -> int:
        """Sends a prefetch for each key not already on its way, while the budget allows; returns
        how many were sent. The prefetches of the `running` layer, whose step is under way and
        takes or cancels them next, do not count against the budget: else they would keep the
        furthest layers ahead from being asked for. Never raises for the daemon's sake: demand
        finds out and recovers."""
        with self.link._lock:
            client = self._live()
            if client is None:
                return 0
            leaving = (len(self._of_layer.get(running, ()))
                       + sum(pending.key.layer == running and pending.client is client for pending in self.taken)
                       ) if running is not None else 0
            room = prefetch_budget(prefetch_share(client)) - self.held + leaving
            sent = 0
            try:
                for key in keys:
                    if room <= 0:
                        break
                    if key in self.entries:
                        continue
                    self.entries[key] = client.submit(key)
                    self._of_layer.setdefault(key.layer, set()).add(key)
                    room -= 1
                    sent += 1
            except ClientError as exc:
                log.debug("prefetch not sent: %s", exc)
            return sent

    def cancel(self, layer: int, keep: Collection[int] = ()) -> int:
        """Cancels the prefetches of `layer` still held but for the experts in `keep` (its routing
        is known, or its step has run: they are stale); returns how many. Nothing to do (prefetch
        off, or nothing sent or left unanswered) costs no socket poll: this runs every layer."""
        client = self.link.client
        if not self.entries and (client is None or not client.abandoned):
            return 0
        with self.link._lock:
            if self._live() is None:
                return 0
            stale = [key for key in self._of_layer.get(layer, ()) if key.expert not in keep]
            for key in stale:
                self._pop(key).cancel()
            self._pump()
            return len(stale)

    def cancel_all(self) -> None:
        with self.link._lock:
            if self._live() is None:
                return
            for pending in self.entries.values():
                pending.cancel()
            self._clear()

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Waits for the answers of cancelled prefetches, so every slot they held is back."""
        with self.link._lock:
            client = self._live()
            if client is None:
                return
            try:
                client.settle(timeout_s)
            except ClientError as exc:
                log.debug("answers of cancelled prefetches not all in: %s", exc)

    def _pump(self) -> None:
        """Reads what has arrived, so that late answers to cancelled prefetches give their slots back."""
        client = self.link.client
        if client is None:
            return
        try:
            client.pump()
        except ClientError as exc:
            log.debug("reading prefetch answers: %s", exc)

    # ---- demand ------------------------------------------------------------------------------
    def fetch(self, keys: list[ExpertKey], on_sent: Callable[[], None] | None = None
              ) -> Iterator[tuple[Expert, bool]]:
        """Every key as a demand fetch would give it, and whether a prefetch brought it: first the
        prefetched ones already in, then the rest fetched at DEMAND priority as they arrive, then
        the prefetched ones still on the way, promoted to DEMAND priority. Where prefetched ones are
        in, the rest are asked for before those are handed over (one FETCH each), so that their
        copies overlap its reads rather than delay its request. `on_sent` runs once the demand is
        sent and promoted, before the first wait: the later layers' prefetches go behind it, so
        that idle readers take the keys the model waits for first. A fetch that failed or died is
        fetched again on demand (which raises what the daemon says, or reconnects)."""
        with self.link._lock:
            client = self._live()
            if client is not None:
                self._pump()
                self.taken = [self._pop(key) for key in keys if key in self.entries]
            prefetched = {pending.key for pending in self.taken}
            rest = [key for key in keys if key not in prefetched]
            arrived = [pending for pending in self.taken if pending.answered]
            waiting = [pending for pending in self.taken if not pending.answered]
            demand = self._ask(client, rest) if arrived and rest else None
            for pending in waiting:  # needed now: no longer behind other clients' demand reads
                pending.promote()
            again: list[ExpertKey] = []
            try:
                if on_sent is not None and (demand is not None or not rest):
                    on_sent()
                for pending in arrived:
                    yield from self._result(pending, again)
                if demand is not None:
                    for pending in demand:
                        yield from self._result(pending, again, prefetched=False)
                elif rest:
                    yield from ((expert, False) for expert in self.link.fetch(rest, on_sent))
                for pending in waiting:
                    yield from self._result(pending, again)
                if again:
                    self.link.refetched += len(again)
                    yield from ((expert, False) for expert in self.link.fetch(again))
            finally:
                for pending in self.taken:  # left early: what was not handed out goes back
                    pending.cancel()
                self.taken = []

    def _ask(self, client: ExpertClient | None, keys: list[ExpertKey]) -> list[Pending] | None:
        """Sends a DEMAND FETCH of each key now (taken, as prefetches are: handed over or cancelled
        by fetch()); None when it cannot be sent (the daemon's link's own fetch then recovers)."""
        if client is None:
            return None
        asked: list[Pending] = []
        try:
            for key in keys:
                asked.append(client.submit(key, Priority.DEMAND))
        except ClientError as exc:
            log.debug("demand not sent ahead (%s): fetched after the prefetched ones", exc)
            for pending in asked:
                pending.cancel()
            self.link.refetched += len(asked)
            return None
        self.taken += asked
        return asked

    def _result(self, pending: Pending, again: list[ExpertKey], prefetched: bool = True
                ) -> Iterator[tuple[Expert, bool]]:
        """The expert, or its key added to `again` when it cannot come from this request."""
        self.taken.remove(pending)
        if pending.client is not self.link.client:
            again.append(pending.key)  # the session it was sent on is gone, and its slot with it
            return
        try:
            expert = pending.result()
        except ClientError as exc:  # FAIL (FetchFailed), the daemon gone, no answer in time
            log.debug("%s of %s not delivered (%s): fetching it on demand", "prefetch" if prefetched else "demand",
                      tuple(pending.key), exc)
            pending.cancel()
            again.append(pending.key)
            return
        yield expert, prefetched
