"""A worker whose layers are split over several devices (issue 16), on the CPU: `cpu,cpu` runs the
same split as `cuda:0,cuda:1` in one process (each range's tensors, KV rows and expert source on
its own "device", the state handed on at each boundary), and must give the logits of one device
bit for bit: prompt and decode, experts read from the file, resident, or streamed by a real
expertd into one expert cache per device sharing one connection. tests/gpu/test_multi_gpu.py runs
the same checks over two GPUs, where the hand-over really copies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertpack.packtools.layout import ExpertKey
from expertpack.worker.engine.engine import Engine
from expertpack.worker.experts.cache_policy import CacheTooSmall
from expertpack.worker.experts.expert_cache import ExpertCache, prefetch_rates
from expertpack.worker.experts.split_experts import CacheGroup, SplitExperts
from expertpack.worker.nn import placement
from expertpack.worker.nn.placement import tensor_layer
from expertpack.worker.serve.tokenizer import load_tokenizer
from expertpack.worker.weights.model_files import ResidentExperts

from ..conftest import CACHED, FIXTURES, run_cli
from ..helpers.engine import PROMPT, assert_same, daemon_for, greedy_run, minimal_cache_bytes
from ..helpers.worker import local_greedy, start_worker

MODELS = {  # one GGUF per architecture, each deep enough to split
    "qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",
    "deepseek2": "gguf/deepseek3-a/deepseek3-a.Q4_K_M.gguf",  # a dense leading layer, shared experts, MLA
    "deepseek4": "flagship/deepseek4/dsv4-tiny.Q2_K.gguf",  # hyper-connection streams, hash-routed layers
    "kimi-k3": "flagship/kimi-k3/k3-tiny.Q2_K.gguf",  # KDA states, banked residuals
    "gpt-oss": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
    "llama": "gguf/mixtral-a/mixtral-a.Q4_K_M.gguf",
}


def run(engine: Engine, n: int = 4) -> tuple[list[torch.Tensor], list[int]]:
    return greedy_run(engine, PROMPT, n)


def device_lists(engine: Engine) -> list[str]:
    n_layer = int(engine.files.metadata[f"{engine.files.arch}.block_count"])
    return ["cpu,cpu"] + (["cpu,cpu,cpu"] if n_layer >= 3 else [])


@pytest.mark.parametrize("arch,resident", [(arch, True) for arch in sorted(MODELS)] + [("qwen3moe", False)],
                         ids=[f"{arch}-resident" for arch in sorted(MODELS)] + ["qwen3moe-from-file"])
def test_split_over_devices_is_bit_identical(arch: str, resident: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert resident (one table per device), and for one model read from the file per step.
    Each hand-over copies the state, as a move between GPUs does (on the CPU `.to` would alias it),
    so nothing downstream may rely on sharing a tensor with the range before."""
    moved = placement._moved
    copies = []

    def copying(value, device):
        out = moved(value, device)
        if isinstance(out, torch.Tensor):
            out = out.clone()
            copies.append(out.shape)
        return out

    monkeypatch.setattr(placement, "_moved", copying)
    path = FIXTURES / MODELS[arch]
    single = Engine.load(path, "cpu", resident_experts=resident)
    want = run(single)
    n_layer = int(single.files.metadata[f"{arch}.block_count"])
    single.close()
    for devices in device_lists(single):
        engine = Engine.load(path, devices, resident_experts=resident)
        try:
            place = engine.place
            assert len(place.devices) == devices.count(",") + 1 and place.split
            ranges = place.ranges(n_layer)
            assert sorted(i for r in ranges for i in r) == list(range(n_layer))
            assert all(len(r) for r in ranges)
            for name, t in engine.model.w.items():  # every block tensor on its layer's device
                layer = tensor_layer(name)
                if layer is not None:
                    assert t.raw.device == place.device_of(layer), name
            if resident:
                source = engine.files.experts
                assert isinstance(source, SplitExperts)
                for layer, part in source.source_of.items():  # each device holds its own layers' experts only
                    assert isinstance(part, ResidentExperts)
                    assert set(part.tables) <= set(ranges[place.part_of(layer)])
            before = len(copies)
            assert_same(run(engine), want, f"{arch} over {devices}")
            assert len(copies) > before  # the state was handed on
        finally:
            engine.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "kimi-k3"])
def test_split_static_decode_steps_are_bit_identical(arch: str) -> None:
    """The GPU's decode step shape (the position a device tensor, the KV buffers attended whole):
    every range reads the step's position on its own device."""
    def steps(devices: str) -> torch.Tensor:
        engine = Engine.load(FIXTURES / MODELS[arch], devices, resident_experts=True)
        seq = engine.new_sequence()
        engine.forward(PROMPT, seq)
        cache = seq.kv
        cache.reserve(300)
        position = torch.zeros(1, dtype=torch.int64)
        cache.step_positions = position
        out = []
        with torch.inference_mode():
            for t in [33, 7, 1000]:
                position.fill_(cache.length)
                out.append(engine.model.forward(torch.tensor([t]), cache).to(torch.float32))
        engine.close()
        return torch.cat(out)

    want = steps("cpu")
    assert torch.equal(steps("cpu,cpu"), want)


# ---- through expertd: one expert cache per device, one connection ---------------------------------
# (the packs: conftest.py's split_packs, which tests/kernels/test_split_kernels.py takes too)


@pytest.mark.parametrize("arch", sorted(CACHED))
def test_split_expert_caches_share_one_daemon_and_are_bit_identical(arch: str, split_packs, tmp_path: Path) -> None:
    pack = split_packs[arch]
    resident = Engine.load(pack, resident_experts=True)
    prompt2 = PROMPT[::-1]  # experts partly those of the first prompt
    want = [run(resident), greedy_run(resident, prompt2, 3)]
    resident.close()
    d = daemon_for(pack, tmp_path)
    minimal = minimal_cache_bytes(pack)
    engine = Engine.load(pack, "cpu,cpu", daemon=d.endpoint, cache_bytes=2 * minimal)  # CPU devices split the budget
    try:
        group = engine.expert_cache
        assert isinstance(group, CacheGroup) and len(group.caches) == 2
        assert {id(c.link) for c in group.caches} == {id(group.link)}  # one connection
        assert group.caches[0]._pending is group.caches[1]._pending  # its staging leases, shared
        for cache in group.caches:  # the smallest cache there is: every step evicts
            assert isinstance(cache, ExpertCache) and cache.n_slots == engine.files.experts.manifest.model.n_expert_used
        engine.model.moe.routing_log = {}
        before = group.counters.snapshot()
        assert_same(run(engine), want[0], f"{arch}: split caches, first prompt")
        assert_same(greedy_run(engine, prompt2, 3), want[1], f"{arch}: split caches, second prompt")
        ranges = engine.place.ranges(int(engine.files.metadata[f"{engine.files.arch}.block_count"]))
        for k, cache in enumerate(group.caches):  # each cache held only its own device's layers
            held = {key.layer for key in cache.policy.slot_of}
            assert held and held <= set(ranges[engine.place.part_of(min(held))])
        layers_of = [{key.layer for key in c.policy.slot_of} for c in group.caches]
        assert not layers_of[0] & layers_of[1]
        group.link.settle()  # expertd has handled the cancels of stale prefetches
        stats = group.stats()
        c, daemon = stats["cache"], stats["daemon"]
        counted = group.counters.since(before)
        assert c == {**counted, **prefetch_rates(counted), "slots": group.n_slots, "slot_bytes": group.slot_bytes,
                     "resident_bytes": group.resident_bytes, "staging_pinned": False, "reconnects": 0,
                     "refetched": 0}
        assert c["misses"] == sum(dev["misses"] for dev in stats["devices"]) > 0
        assert all(dev["misses"] > 0 for dev in stats["devices"])
        # each miss asked once, on demand or ahead; stale prefetches were cancelled (or read, then released)
        assert daemon["keys"] == c["misses"] - c["prefetch_used"] + c["prefetch_issued"]
        assert daemon["ready"] + daemon["cancelled"] == daemon["keys"] and daemon["failed"] == daemon["cancelled"]
        assert c["prefetch_issued"] == c["prefetch_used"] + c["prefetch_stale"]  # within each device's own layers
        unique = sum(len(set(ids.flatten().tolist())) for calls in engine.model.moe.routing_log.values() for ids in calls)
        assert c["hits"] + c["misses"] == unique
        assert all(isinstance(k, ExpertKey) for cache in group.caches for k in cache.policy.slot_of)
    finally:
        engine.close()
        assert d.stop()[0] == 0


# ---- the command line ------------------------------------------------------------------------------
def test_eval_over_cpu_devices_saves_the_same_logits(tmp_path: Path) -> None:
    path = FIXTURES / MODELS["deepseek2"]
    out = {}
    for devices in ("cpu", "cpu,cpu,cpu"):
        logits = tmp_path / f"{devices}.npy"
        proc = run_cli("eval", path, "--tokens", ",".join(map(str, PROMPT)), "--greedy", "3", "--device", devices,
                       "--save-logits", logits, "--json", check=True)
        out[devices] = (json.loads(proc.stdout), np.load(logits))
    (one, one_logits), (three, three_logits) = out["cpu"], out["cpu,cpu,cpu"]
    assert three["continuation"] == one["continuation"] and np.array_equal(three_logits, one_logits)
    assert three["layers"] == [["cpu", 0, 0], ["cpu", 1, 1], ["cpu", 2, 2]] and "layers" not in one
    proc = run_cli("eval", FIXTURES / MODELS["qwen3moe"], "--tokens", "1,2", "--device", "cpu,cpu,cpu")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "expertpack eval: 3 devices for a model of 2 layers: each device needs at least one layer; name at most 2 "
        "devices"], proc.stderr


def test_expert_worker_over_cpu_devices_serves_one_devices_answer(split_packs, tmp_path: Path) -> None:
    """expert-worker --device cpu,cpu against a real expertd: the split is logged, the answer is the
    in-process engine's on one device, /metrics adds the two caches' counters up (the experts the
    worker read at start: the model fits its caches)."""
    pack = split_packs["qwen3moe"]
    local = Engine.load(pack)
    tokenizer = load_tokenizer(local.files.metadata)
    prompt = "The quick brown fox"
    want = local_greedy((local, tokenizer), tokenizer.encode(prompt), 8)
    d = daemon_for(pack, tmp_path)
    worker = start_worker(pack, d.endpoint, tmp_path, "--device", "cpu,cpu", "--cache-vram-mib", "2")
    try:
        got = worker.client().completions.create(model="fixture", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want
        status, metrics = worker.get("/metrics")
        # the model fits the two caches: the worker read every expert once at start (ExpertCache.fill)
        misses = [line for line in metrics.splitlines() if line.startswith("expertpack_cache_misses_total")]
        assert status == 200 and misses and float(misses[0].split()[-1]) > 0, metrics
        assert got.model_extra["expertpack"]["fetched_bytes"] == 0
        assert worker.get("/health")[0] == 200
    finally:
        assert worker.stop() == 0, worker.log
        assert d.stop()[0] == 0
    assert "layers split over 2 devices: cpu 0..0, cpu 1..1" in worker.log, worker.log
    assert "Traceback" not in worker.log


def test_a_split_cache_too_small_names_its_device(split_packs, tmp_path: Path) -> None:
    pack = split_packs["qwen3moe"]
    d = daemon_for(pack, tmp_path)
    try:
        with pytest.raises(CacheTooSmall) as err:  # enough for one device, not for two sharing it
            Engine.load(pack, "cpu,cpu", daemon=d.endpoint, cache_bytes=minimal_cache_bytes(pack))
        assert str(err.value).startswith("cpu (MoE layers 0..0): an expert cache of")
        assert str(err.value).endswith("the 2 CPU devices share the budget evenly")
    finally:
        assert d.stop()[0] == 0
