"""Prefetch (worker/experts/lookahead.py, worker/experts/prefetch.py) against a real expertd process, on the CPU:

- across the fixture architectures (DeepSeek-V4's hash layers and Kimi-K3's latent experts
  included), a cache of the minimum size with prefetch on gives the resident run's logits bit for
  bit; every prefetch is counted used or stale, precision and recall follow from the counters
  (/metrics too), expertd was asked each miss once (on demand or ahead) plus the stale ones; and
  after the run no staging slot or RAM tier hold is left with the worker;
- DeepSeek-V4's hash layers are fetched exactly: no prefetch for a hash layer goes stale;
- a prefetched expert is copied in without a second read, byte for byte the pack's, whether it had
  arrived or was still being read when its layer asked;
- stale prefetches are cancelled and every slot they held comes back, arrived or not; on the
  kernels' path as soon as the layer's routing is known;
- prefetches hold at most their budget of the client's staging, or over expertd's RAM tier of its
  RAM hold share (v6), and demand is served while they hold all of it; prefetches go at PREFETCH priority, one key each, demand at DEMAND, a layer's
  demand before the prefetches its lookahead sends;
- over expertd's RAM tier, prefetch stays bit-exact and a second pass reads from the pack only
  for mispredicted prefetches.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from expertpack.client import protocol as p
from expertpack.client.protocol import prefetch_budget
from expertpack.packtools.layout import ExpertKey, Manifest
from expertpack.worker.engine.engine import Engine
from expertpack.worker.experts import lookahead
from expertpack.worker.experts.daemon_link import DaemonLink
from expertpack.worker.experts.expert_cache import ExpertCache, slot_bytes
from expertpack.worker.experts.lookahead import LOOKAHEAD_LAYERS
from expertpack.worker.serve.metrics import ServeCounters, render
from expertpack.worker.weights.model_files import PackExperts

from ..conftest import Daemon, start_daemon

ARCHS = ["qwen3moe-a.Q4_K_M", "deepseek3-a.Q4_K_M", "gptoss-a.MXFP4_MOE", "dsv4-tiny.Q2_K", "k3-tiny.Q2_K"]
PROMPT = list(range(5, 25))
DECODE = [3, 9, 27, 81, 11, 7]
CPU = torch.device("cpu")


def daemon_with(pack: Path, tmp: Path, client_slots: int, *extra: str) -> Daemon:
    d = start_daemon(pack, tmp, "--stage-slots", "16", "--client-slots", str(client_slots), *extra)
    d.wait_for("READY=1")
    return d


def run(engine: Engine) -> list[torch.Tensor]:
    """Logits of a prompt, then of decode steps over a fixed token stream."""
    cache = engine.new_sequence()
    out = [engine.forward(PROMPT, cache)]
    for token in DECODE:
        out.append(engine.forward([token], cache))
    return out


def minimal_cache_bytes(pack: Path) -> int:
    manifest = Manifest.load(pack)
    return manifest.model.n_expert_used * slot_bytes(manifest)


def assert_nothing_held(link: DaemonLink) -> None:
    """Once cancelled prefetches are answered, the worker holds no staging slot, and no RAM tier
    block but those its cache keeps (protocol v8: evicted experts it reads where they lie)."""
    assert not link.ahead.entries, "prefetches outlived the run"
    link.settle()
    assert link.ahead.held == 0
    stats = link.stats()
    (client,) = stats["clients"]
    assert client["free"] == client["slots"] and client["queued"] == 0 and client["requests"] == 0
    assert client["ram_held"] == client["ram_kept"] == stats["ram"]["held"]


def record_sent(client, method: str) -> list[p.Message]:
    """Every message the client sends through `method` from now on, in order."""
    sent: list[p.Message] = []
    send = getattr(client, method)
    setattr(client, method, lambda msg: (sent.append(msg), send(msg))[1])
    return sent


def wait_answered(link: DaemonLink, keys: list[ExpertKey], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(link.ahead.entries[k].answered for k in keys):
        assert time.monotonic() < deadline, "prefetches not answered in time"
        link.client.pump()
        time.sleep(0.001)


@pytest.mark.parametrize("name", ARCHS)
def test_prefetch_is_bit_exact_and_counted(name: str, fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs[name][1]
    want = run(Engine.load(pack, resident_experts=True))
    d = daemon_with(pack, tmp_path, 8)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        cache = engine.expert_cache
        hash_layers = set(engine.model.moe.static_routes)
        issued_by_layer: dict[int, int] = {}
        stale_by_layer: dict[int, int] = {}
        prefetch, layer_done = cache.prefetch, cache.layer_done

        def counted_prefetch(layer: int, experts: list[int], running: int | None = None) -> None:
            before = cache.counters.prefetch_issued
            prefetch(layer, experts, running)
            issued_by_layer[layer] = issued_by_layer.get(layer, 0) + cache.counters.prefetch_issued - before

        def counted_layer_done(layer: int) -> None:
            before = cache.counters.prefetch_stale
            layer_done(layer)
            stale_by_layer[layer] = stale_by_layer.get(layer, 0) + cache.counters.prefetch_stale - before

        cache.prefetch, cache.layer_done = counted_prefetch, counted_layer_done
        got = run(engine)
        for step, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name}: logits of step {step} differ from the resident run with prefetch on"

        cache.link.settle()
        stats = cache.stats()
        c, daemon = stats["cache"], stats["daemon"]
        assert c["prefetch_used"] > 0 and c["misses"] > c["prefetch_used"]  # a minimal cache misses a lot
        assert c["prefetch_issued"] == c["prefetch_used"] + c["prefetch_stale"] == sum(issued_by_layer.values())
        assert c["prefetch_stale"] == sum(stale_by_layer.values())
        assert daemon["keys"] == c["misses"] - c["prefetch_used"] + c["prefetch_issued"]
        assert daemon["ready"] + daemon["cancelled"] == daemon["keys"] and daemon["failed"] == daemon["cancelled"]
        assert c["prefetch_precision"] == c["prefetch_used"] / c["prefetch_issued"]
        assert c["prefetch_recall"] == c["prefetch_used"] / c["misses"]
        assert c["h2d_bytes"] <= daemon["pack_read_bytes"]
        if hash_layers:  # the token-id table says exactly what a hash layer needs: nothing goes stale
            assert sum(issued_by_layer.get(l, 0) for l in hash_layers) > 0
            assert sum(stale_by_layer.get(l, 0) for l in hash_layers) == 0
        values = {line.split(" ")[0]: float(line.split(" ")[1])
                  for line in render(ServeCounters(), c, daemon).splitlines() if line.startswith("expertpack_cache_prefetch")}
        assert values == {"expertpack_cache_prefetch_issued_total": c["prefetch_issued"],
                          "expertpack_cache_prefetch_used_total": c["prefetch_used"],
                          "expertpack_cache_prefetch_stale_total": c["prefetch_stale"],
                          "expertpack_cache_prefetch_precision": c["prefetch_precision"],
                          "expertpack_cache_prefetch_recall": c["prefetch_recall"]}
        assert_nothing_held(cache.link)
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_prefetch_off_sends_nothing_ahead(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_with(pack, tmp_path, 8)
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack), prefetch=False)
    try:
        run(engine)
        engine.expert_cache.link.settle()
        stats = engine.expert_cache.stats()
        assert stats["cache"]["prefetch_issued"] == stats["cache"]["prefetch_used"] == 0
        assert stats["daemon"]["keys"] == stats["daemon"]["ready"] == stats["cache"]["misses"]
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_the_lookahead_asks_for_the_next_layers_nearest_first(tiny_pack: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """While MoE layer L runs, the experts of the next LOOKAHEAD_LAYERS MoE layers are asked for
    (their routers on L's input), in the order they run, and none past the last layer."""
    depth = 2  # fewer than the fixture's layers
    monkeypatch.setattr(lookahead, "LOOKAHEAD_LAYERS", depth)
    pack = tiny_pack  # 4 MoE layers, top-4
    k = Manifest.load(pack).model.n_expert_used
    slots = str(2 * k * depth)  # a prefetch budget (half) of k for each layer ahead
    d = start_daemon(pack, tmp_path, "--stage-slots", slots, "--client-slots", slots, "--max-client-slots", slots)
    d.wait_for("READY=1")
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        cache = engine.expert_cache
        served = cache.served
        assert len(served) > depth >= 2, "the fixture has layers to look ahead over"
        asked: list[tuple[int, int, int]] = []  # (the layer done before, layer asked for, experts asked)
        done: list[int] = []
        prefetch, layer_done = cache.prefetch, cache.layer_done

        def recorded_prefetch(layer: int, experts: list[int], running: int | None = None) -> None:
            asked.append((done[-1] if done else -1, layer, len(experts)))
            prefetch(layer, experts, running)

        def recorded_layer_done(layer: int) -> None:
            done.append(layer)  # the next layer's lookahead runs after this one is done
            layer_done(layer)

        cache.prefetch, cache.layer_done = recorded_prefetch, recorded_layer_done
        state = engine.new_sequence()
        engine.forward(PROMPT, state)
        asked.clear()
        done.clear()
        engine.forward([3], state)
        want = []
        for i in range(len(served)):
            ahead = served[i + 1:i + 1 + depth]
            want += [(served[i - 1] if i else -1, target, k) for target in ahead]  # a token's k experts
        assert asked == want
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_a_layers_misses_are_asked_for_before_the_layers_ahead(tiny_pack: Path, tmp_path: Path) -> None:
    """At every MoE layer of a decode step, the layer's own DEMAND FETCH goes out before the
    prefetches of the layers ahead that its lookahead sends: expertd's idle readers start on what
    the model waits for (sent after them, it had waited for the prefetches' reads in flight: at a
    token's first layer, where nothing was asked for ahead, most of its fetch time on the H200).
    The same holds for a segmented decode step's host work (ExpertFFN.host_step, the GPU's decode)."""
    pack = tiny_pack
    k = Manifest.load(pack).model.n_expert_used
    slots = str(2 * k * LOOKAHEAD_LAYERS)
    d = start_daemon(pack, tmp_path, "--stage-slots", slots, "--client-slots", slots, "--max-client-slots", slots)
    d.wait_for("READY=1")
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        cache = engine.expert_cache
        events: list[tuple[str, int]] = []  # ("demand", layer) as sent; ("ahead", running layer) as asked
        send = cache.link.client._send

        def recorded_send(msg: p.Message) -> None:
            if isinstance(msg, p.Fetch) and msg.prio is p.Priority.DEMAND:
                events.append(("demand", msg.keys[0].layer))
            send(msg)

        prefetch = cache.prefetch

        def recorded_prefetch(layer: int, experts: list[int], running: int | None = None) -> None:
            events.append(("ahead", running))
            prefetch(layer, experts, running)

        def assert_demand_first() -> None:
            missed = {layer for kind, layer in events if kind == "demand" and cache.ahead(layer, LOOKAHEAD_LAYERS)}
            assert missed, "the minimal cache misses at a decode step, on a layer with layers ahead"
            for layer in missed:
                assert ("ahead", layer) in events
                assert events.index(("ahead", layer)) > events.index(("demand", layer)), (layer, events)

        cache.link.client._send, cache.prefetch = recorded_send, recorded_prefetch
        state = engine.new_sequence()
        engine.forward(PROMPT[:4], state)
        for token in DECODE[:3]:
            events.clear()
            engine.forward([token], state)
            assert_demand_first()
        first, second = cache.served[:2]
        cached = {key.expert for key in cache.policy.slot_of if key.layer == first}
        chosen = [e for e in range(Manifest.load(pack).model.n_expert) if e not in cached][:k]
        events.clear()
        engine.model.moe.host_step(first, chosen, [(second, list(range(k)))])
        assert_demand_first()
    finally:
        engine.close()
        assert d.stop()[0] == 0


@pytest.fixture
def qwen3(fixture_packs, tmp_path: Path):
    """(manifest, pack, daemon with 8 slots for the client) of the qwen3moe fixture."""
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    d = daemon_with(pack, tmp_path, 8)
    yield Manifest.load(pack), pack, d
    assert d.stop()[0] == 0


def assert_as_packed(loaded: dict, direct: PackExperts, layer: int, experts: list[int]) -> None:
    """The cache loaded exactly `experts`, each holding, role by role, the bytes of the pack itself."""
    assert sorted(loaded) == sorted(experts)
    want = direct.load(layer, experts)
    for e in experts:
        for role, tensor in want[e].items():
            assert torch.equal(loaded[e][role].raw, tensor.raw), f"expert {e} {role}"


def cache_on(manifest: Manifest, d: Daemon, slots: int | None = None) -> ExpertCache:
    link = DaemonLink(d.endpoint, manifest.fingerprint, CPU, timeout_s=10.0, down_timeout_s=5.0)
    n = slots or manifest.model.n_expert_used
    return ExpertCache(manifest, link, CPU, n * slot_bytes(manifest))


def test_a_prefetched_expert_is_copied_in_without_a_second_read(qwen3) -> None:
    manifest, pack, d = qwen3
    cache = cache_on(manifest, d, slots=4)
    direct = PackExperts(pack, manifest)
    try:
        layer = manifest.layers[1].layer
        arrived, on_the_way = [ExpertKey(layer, 0), ExpertKey(layer, 1)], [ExpertKey(layer, 2), ExpertKey(layer, 3)]
        cache.prefetch(layer, [k.expert for k in arrived])
        wait_answered(cache.link, arrived)
        cache.prefetch(layer, [k.expert for k in on_the_way])  # asked for at once: most likely still being read
        cache.link.settle()
        before = cache.link.stats()["counters"]
        keys = arrived + on_the_way
        loaded = cache.load(layer, [k.expert for k in keys])
        after = cache.link.stats()["counters"]
        assert after["keys"] == before["keys"] == 4  # no demand FETCH: the prefetches delivered
        assert after["pack_read_bytes"] == 4 * manifest.layer(layer).stride  # each block read once
        assert_as_packed(loaded, direct, layer, [k.expert for k in keys])
        c = cache.counters
        assert (c.misses, c.prefetch_issued, c.prefetch_used, c.prefetch_stale) == (4, 4, 4, 0)
        cache.layer_done(layer)
        assert c.prefetch_stale == 0
        assert_nothing_held(cache.link)
    finally:
        direct.close()
        cache.close()


def test_the_rest_is_asked_for_before_the_prefetched_experts_are_copied(qwen3) -> None:
    """Two of a layer's four experts were prefetched and are in: the DEMAND FETCHes of the other two
    go out before the first prefetched expert is copied in (its copy then overlaps their reads),
    and all four arrive byte for byte the pack's, each read once."""
    manifest, pack, d = qwen3
    cache = cache_on(manifest, d, slots=4)
    direct = PackExperts(pack, manifest)
    sent = record_sent(cache.link.client, "_send")
    demands_at_copy: list[int] = []
    copy_in = cache._copy_in
    cache._copy_in = lambda *a, **kw: (demands_at_copy.append(sum(isinstance(m, p.Fetch) and m.prio is p.Priority.DEMAND
                                                                  for m in sent)), copy_in(*a, **kw))[1]
    try:
        layer = manifest.layers[1].layer
        cache.prefetch(layer, [0, 1])
        wait_answered(cache.link, [ExpertKey(layer, 0), ExpertKey(layer, 1)])
        loaded = cache.load(layer, [0, 1, 2, 3])
        assert demands_at_copy[0] == 2 and len(demands_at_copy) == 4
        demands = [m for m in sent if isinstance(m, p.Fetch) and m.prio is p.Priority.DEMAND]
        assert sorted(key for m in demands for key in m.keys) == [ExpertKey(layer, 2), ExpertKey(layer, 3)]
        assert cache.link.stats()["counters"]["pack_read_bytes"] == 4 * manifest.layer(layer).stride
        assert_as_packed(loaded, direct, layer, [0, 1, 2, 3])
        c = cache.counters
        assert (c.misses, c.prefetch_issued, c.prefetch_used) == (4, 2, 2)
        cache.layer_done(layer)
        assert_nothing_held(cache.link)
    finally:
        direct.close()
        cache.close()


def test_prefetches_still_on_the_way_are_promoted_when_their_layer_needs_them(qwen3) -> None:
    """expertd is stopped while a layer's prefetches are sent and the layer asks for them: none has
    arrived, so each is PROMOTEd to DEMAND priority (protocol v5) before the worker waits; once
    expertd runs again they arrive, byte for byte the pack's, each read once."""
    import os
    import signal
    import threading

    manifest, pack, d = qwen3
    cache = cache_on(manifest, d, slots=4)
    direct = PackExperts(pack, manifest)
    sent: list[p.Message] = []
    put = cache.link.client._put
    cache.link.client._put = lambda msg: (sent.append(msg), put(msg))[1]
    layer = manifest.layers[1].layer
    loaded: dict = {}
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        cache.prefetch(layer, [0, 1])
        worker = threading.Thread(target=lambda: loaded.update(cache.load(layer, [0, 1])))
        worker.start()
        deadline = time.monotonic() + 10
        while sum(isinstance(m, p.Promote) for m in sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    try:
        worker.join(30)
        promoted = [m.id for m in sent if isinstance(m, p.Promote)]
        prefetched = [m.id for m in sent if isinstance(m, p.Fetch) and m.prio is p.Priority.PREFETCH]
        assert sorted(promoted) == sorted(prefetched) and len(promoted) == 2
        assert not [m for m in sent if isinstance(m, p.Fetch) and m.prio is p.Priority.DEMAND]
        assert cache.link.stats()["counters"]["pack_read_bytes"] == 2 * manifest.layer(layer).stride
        assert_as_packed(loaded, direct, layer, [0, 1])
        cache.layer_done(layer)
        assert_nothing_held(cache.link)
    finally:
        direct.close()
        cache.close()


@pytest.mark.parametrize("prefetched", [0, 2], ids=["demand-alone", "some-prefetched"])
def test_a_failing_lookahead_after_the_demand_leaves_nothing_held(prefetched: int, qwen3) -> None:
    """What a step sends behind its misses (the lookahead) runs once they are asked for; when it
    raises, the error reaches the caller and the step's requests are cancelled, their slots back:
    nothing is held past it, and the next step is served."""
    manifest, pack, d = qwen3
    cache = cache_on(manifest, d, slots=4)
    direct = PackExperts(pack, manifest)
    try:
        layer = manifest.layers[1].layer
        if prefetched:
            cache.prefetch(layer, list(range(prefetched)))
            wait_answered(cache.link, [ExpertKey(layer, e) for e in range(prefetched)])

        def lookahead_fails() -> None:
            raise RuntimeError("the lookahead failed")

        with pytest.raises(RuntimeError, match="the lookahead failed"):
            cache.load(layer, [0, 1, 2, 3], then=lookahead_fails)
        assert not cache.policy.slot_of, "nothing half-fetched is taken as cached"
        cache.layer_done(layer)
        assert_nothing_held(cache.link)
        loaded = cache.load(layer, [0, 1, 2, 3])
        assert_as_packed(loaded, direct, layer, [0, 1, 2, 3])
    finally:
        direct.close()
        cache.close()


def test_stale_prefetches_are_cancelled_and_their_slots_come_back(qwen3) -> None:
    manifest, _, d = qwen3
    cache = cache_on(manifest, d)
    try:
        budget = prefetch_budget(8)
        layer = manifest.layers[1].layer
        cache.prefetch(layer, [0, 1])
        wait_answered(cache.link, [ExpertKey(layer, 0), ExpertKey(layer, 1)])  # these hold slots now
        cache.prefetch(layer, list(range(2, manifest.model.n_expert)))  # only what the budget leaves is sent
        assert cache.counters.prefetch_issued == budget == cache.link.ahead.held == 4
        cache.prefetch(layer, [0])  # on its way already: not sent twice
        assert cache.counters.prefetch_issued == budget
        cache.layer_done(manifest.layers[0].layer)  # another layer ran: these are not its
        assert cache.counters.prefetch_stale == 0 and len(cache.link.ahead.entries) == budget
        cache.layer_done(layer)  # their layer ran without them
        assert cache.counters.prefetch_stale == budget and not cache.link.ahead.entries
        assert_nothing_held(cache.link)
        counters = cache.link.stats()["counters"]
        assert counters["keys"] == budget and counters["ready"] + counters["cancelled"] == budget
        assert counters["ready"] >= 2  # the two that had arrived were released, not cancelled
    finally:
        cache.close()


def test_once_a_layer_has_routed_its_unchosen_prefetches_are_cancelled_before_its_reads(qwen3) -> None:
    """The kernels' path (expert_rows, run here on the CPU) knows the layer's whole selection
    before its first wave: prefetches it did not choose are cancelled then, the chosen ones used."""
    manifest, _, d = qwen3
    cache = cache_on(manifest, d)
    try:
        layer = manifest.layers[1].layer
        cache.prefetch(layer, [5, 6, 7])
        seen: list[int] = []
        cancel = cache.link.ahead.cancel
        cache.link.ahead.cancel = lambda l, keep=(): (seen.append(cache.link.ahead.held), cancel(l, keep))[1]
        rows = list(cache.expert_rows(layer, torch.tensor([[6, 0], [0, 6]])))
        assert len(rows) == 1 and seen == [3]  # cancelled once, with all three still held
        c = cache.counters
        assert (c.prefetch_issued, c.prefetch_used, c.prefetch_stale, c.misses) == (3, 1, 2, 2)
        cache.layer_done(layer)
        assert c.prefetch_stale == 2
        assert_nothing_held(cache.link)
    finally:
        cache.close()


def test_demand_is_served_while_prefetches_hold_all_they_may(qwen3) -> None:
    """With the client's 8 slots, prefetches may hold 4; demand for more experts than the 4 left
    still completes (it would wait forever if prefetches could hold every slot), at DEMAND
    priority, while the prefetches, one key per FETCH at PREFETCH priority, stay held."""
    manifest, _, d = qwen3
    k = manifest.model.n_expert_used
    cache = cache_on(manifest, d, slots=2 * k)
    sent = record_sent(cache.link.client, "_send")
    try:
        ahead, now = manifest.layers[1].layer, manifest.layers[0].layer
        cache.prefetch(ahead, list(range(manifest.model.n_expert)))
        held = [key for key in cache.link.ahead.entries]
        assert len(held) == prefetch_budget(8) == 4
        wait_answered(cache.link, held)
        loaded = cache.load(now, list(range(2 * k)))
        assert sorted(loaded) == list(range(2 * k)) and cache.counters.misses == 2 * k
        assert sorted(cache.link.ahead.entries) == sorted(held)  # untouched by demand for another layer
        fetches = [m for m in sent if isinstance(m, p.Fetch)]
        prefetches = [m for m in fetches if m.prio is p.Priority.PREFETCH]
        demands = [m for m in fetches if m.prio is p.Priority.DEMAND]
        assert [m.keys for m in prefetches] == [(key,) for key in held]
        assert sorted(key for m in demands for key in m.keys) == [ExpertKey(now, e) for e in range(2 * k)]
        cache.layer_done(ahead)
        assert_nothing_held(cache.link)
    finally:
        cache.close()


def test_the_running_layers_prefetches_leave_the_budget_to_the_layers_ahead(qwen3) -> None:
    """A step's own prefetches are taken or cancelled by that step: prefetches it sends for later
    layers may use the budget they hold, and only from that step (else the lookahead could not
    reach past the next layer). expertd starts them once the step's own are taken (prefetches use
    at most half the client's staging there, v6), and demand for the running layer completes."""
    manifest, _, d = qwen3
    k = manifest.model.n_expert_used
    cache = cache_on(manifest, d, slots=2 * k)
    try:
        now, ahead = manifest.layers[0].layer, manifest.layers[1].layer
        budget = prefetch_budget(8)  # the client's 8 slots
        cache.prefetch(now, list(range(budget)))
        entries = cache.link.ahead.entries
        assert sorted(entries) == [ExpertKey(now, e) for e in range(budget)]
        cache.prefetch(ahead, list(range(budget)))  # not sent from `now`'s step: no room
        assert not any(key.layer == ahead for key in entries)
        cache.prefetch(ahead, list(range(budget)), running=now)
        assert sorted(key for key in entries if key.layer == ahead) == [ExpertKey(ahead, e) for e in range(budget)]
        assert len(entries) == 8  # as many as the client's staging slots
        wait_answered(cache.link, [key for key in entries if key.layer == now])
        (client,) = cache.link.stats()["clients"]
        assert client["free"] == 4 and client["queued_prefetch"] == 4  # expertd keeps half for demand
        loaded = cache.load(now, list(range(2 * k)))  # its prefetched 4 taken, the rest read into the slots they free
        assert sorted(loaded) == list(range(2 * k)) and cache.counters.prefetch_used == budget
        wait_answered(cache.link, list(entries))  # behind the demand
        cache.layer_done(now)
        cache.layer_done(ahead)
        assert_nothing_held(cache.link)
    finally:
        cache.close()


def test_over_a_ram_tier_prefetches_hold_half_its_hold_share_and_demand_still_runs(fixture_packs, tmp_path: Path) -> None:
    """v6: with expertd's RAM tier (here the whole pack, 16 blocks: a hold share of at most 8), the
    budget is half the client's RAM hold share (4 of 8), not of its 4 staging slots (2); with every
    prefetch it may hold held, demand for another layer's 8 misses, more than the share leaves it,
    completes (each hold given back as its copy is done)."""
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    manifest = Manifest.load(pack)
    d = daemon_with(pack, tmp_path, 4, "--ram-cache-gib", "1", "--client-ram-holds", "8")
    cache = cache_on(manifest, d, slots=manifest.model.n_expert)
    try:
        assert cache.link.client.welcome.ram_holds == 8 and len(cache.link.client.slots) == 4
        now, ahead = manifest.layers[0].layer, manifest.layers[1].layer
        cache.prefetch(ahead, list(range(manifest.model.n_expert)))
        held = list(cache.link.ahead.entries)
        assert len(held) == prefetch_budget(8) == 4
        wait_answered(cache.link, held)
        n = manifest.model.n_expert
        loaded = cache.load(now, list(range(n)))
        assert sorted(loaded) == list(range(n)) and cache.counters.misses == n
        cache.link.settle()  # STATS comes on another socket: let the KEEPs and RELEASEs sent land first
        (client,) = cache.link.stats()["clients"]
        # the prefetches wait in RAM, beside the blocks the cache keeps (the tier less the hold share: 8)
        assert client["ram_held"] == 4 + client["ram_kept"] and client["free"] == client["slots"]
        assert 0 < client["ram_kept"] <= client["ram_keeps"] == 8
        cache.layer_done(ahead)
        assert_nothing_held(cache.link)
    finally:
        cache.close()
        assert d.stop()[0] == 0


def test_prefetch_over_the_ram_tier_is_bit_exact_and_reads_only_for_mispredictions(fixture_packs, tmp_path: Path) -> None:
    pack = fixture_packs["qwen3moe-a.Q4_K_M"][1]
    want = run(Engine.load(pack, resident_experts=True))
    d = daemon_with(pack, tmp_path, 8, "--ram-cache-gib", "1")  # the whole (small) pack fits
    engine = Engine.load(pack, daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
    try:
        cache = engine.expert_cache
        for attempt in range(2):
            for step, (a, b) in enumerate(zip(run(engine), want)):
                assert torch.equal(a, b), f"pass {attempt}: logits of step {step} differ from the resident run"
            cache.link.settle()
            if attempt == 0:
                first = cache.stats()
        stats = cache.stats()
        assert stats["cache"]["prefetch_used"] > first["cache"]["prefetch_used"] > 0
        # The second pass uses only keys the first one used, all resident in RAM by then: it reads at
        # most the blocks of mispredicted prefetches the first pass had not sent (how many were sent
        # depends on when the answers of cancelled ones came in).
        stale = stats["cache"]["prefetch_stale"] - first["cache"]["prefetch_stale"]
        assert stats["daemon"]["ram_misses"] - first["daemon"]["ram_misses"] <= stale
        assert_nothing_held(cache.link)
    finally:
        engine.close()
        assert d.stop()[0] == 0


def test_the_worker_prefetches_unless_told_not_to(tmp_path: Path) -> None:
    from expertpack.worker.serve.main import SettingsError, settings

    assert settings(["--pack", "p"]).prefetch is True
    assert settings(["--pack", "p", "--no-prefetch"]).prefetch is False
    config = tmp_path / "worker.toml"
    config.write_text('pack = "p"\nprefetch = false\n')
    assert settings(["--config", str(config)]).prefetch is False
    assert settings(["--config", str(config), "--prefetch"]).prefetch is True  # flags over the file
    config.write_text('pack = "p"\nprefetch = "yes"\n')
    with pytest.raises(SettingsError, match="prefetch: expected true or false"):
        settings(["--config", str(config)])
