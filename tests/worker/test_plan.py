"""`expertpack plan`: its arithmetic on a real pack (cache slots, the RAM tier, hit rates, bytes per
token, the two tok/s figures and the bound, a prompt's prefill), its disk probe (O_DIRECT on the pack's own file), a
routing trace's hit rates equal to the replay of the worker's and the daemon's policies, the
projection of a truncated pack onto more layers, and the config files it writes read back by the
worker and the daemon."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from expertpack.daemon.config import load_config
from expertpack.packtools.gguf_source import open_source
from expertpack.packtools.layout import Manifest
from expertpack.planner.cache_replay import pack_slot_bytes, replay, requests_of, tiered_hit_rates
from expertpack.planner.plan import _keep_slots
from expertpack.worker.experts.routing_trace import read_trace
from expertpack.worker.serve import main as worker_main

from ..conftest import run_cli

GIB = 1 << 30


def trunk_in_vram(pack: Path) -> int:
    """The trunk's bytes on the GPU: all but its token embedding, which the worker reads from pinned
    host memory (Placement.weights)."""
    m = Manifest.load(pack)
    embedding = sum(t.nbytes for t in open_source(pack / m.trunk.file).tensors if t.name.startswith("token_embd."))
    assert 0 < embedding < m.trunk.size_bytes
    return m.trunk.size_bytes - embedding


def plan_json(*args: str | Path) -> dict:
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_arithmetic_on_a_pack(tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    slot = pack_slot_bytes(m)
    trunk = trunk_in_vram(tiny_pack)
    vram = trunk + 20 * slot + 1000  # twenty slots' worth once the trunk is in
    got = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "0.5",
                    "--pcie-gbps", "10", "--compute-tok-s", "400", "--ram-gib", "0", "--miss-host-ms", "0.5")
    p, i = got["plan"], got["inputs"]
    n_total = len(m.layers) * m.model.n_expert
    k = m.model.n_expert_used
    assert p["slots"] == 20 and p["share_of_experts"] == pytest.approx(20 / n_total)
    hit = p["hit_rate"]
    # uniform routing, simulated: about the cache's share of the experts, less where the layers come in
    # turn and a victim is often of the layer asked for next
    assert 0.6 * 20 / n_total < hit <= 20 / n_total + 0.02
    blocks = (1 - hit) * sum(k * l.stride for l in m.layers)
    payload = (1 - hit) * sum(k * l.payload_bytes for l in m.layers)
    assert p["disk_bytes_per_token"] == pytest.approx(blocks) and p["pcie_bytes_per_token"] == pytest.approx(payload)
    disk_s, pcie_s, compute_s = blocks / 0.5e9, payload / 10e9, 1 / 400
    host_s = (1 - hit) * k * len(m.layers) * 0.5e-3  # the worker's host time for a token's misses
    assert p["host_s"] == pytest.approx(host_s) and host_s > 0
    assert p["tok_s_today"] == pytest.approx(1 / (compute_s + host_s + max(disk_s, pcie_s)))
    assert p["tok_s_overlapped"] == pytest.approx(1 / max(disk_s, pcie_s, compute_s + host_s))
    terms = {"disk": disk_s, "pcie": pcie_s, ("compute" if compute_s >= host_s else "host"): compute_s + host_s}
    assert p["bound"] == max(terms.items(), key=lambda kv: kv[1])[0]
    assert i["sources"]["disk"] == "--disk-gbps" and i["trunk_bytes"] == trunk and i["sources"]["host"] == "--miss-host-ms"
    assert p["ram_slots"] == 0 and p["ram_hit_rate"] == 0
    # prefill of a prompt: each layer's distinct experts of its tokens, once, at the decode hit rate
    pre = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "0.5",
                    "--pcie-gbps", "10", "--ram-gib", "0", "--prompt-tokens", "5", "--prefill-tok-s", "80",
                    "--miss-host-ms", "0")["plan"]
    n = m.model.n_expert
    distinct = n * (1 - (1 - k / n) ** 5)
    assert pre["prefill_experts_per_layer"] == pytest.approx(distinct) and k < distinct < min(n, 5 * k)
    pre_blocks = (1 - pre["hit_rate"]) * distinct * sum(l.stride for l in m.layers)
    pre_payload = (1 - pre["hit_rate"]) * distinct * sum(l.payload_bytes for l in m.layers)
    assert pre["prefill_disk_bytes"] == pytest.approx(pre_blocks)
    assert pre["prefill_pcie_bytes"] == pytest.approx(pre_payload)
    disk_s, pcie_s, compute_s = pre_blocks / 0.5e9, pre_payload / 10e9, 5 / 80
    assert pre["prefill_tok_s_today"] == pytest.approx(5 / (compute_s + max(disk_s, pcie_s)))
    assert pre["prefill_tok_s_overlapped"] == pytest.approx(5 / max(disk_s, pcie_s, compute_s))
    assert pre["prefill_compute_s"] == pytest.approx(compute_s)
    proc = run_cli("plan", tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--prompt-tokens", "0")
    assert proc.returncode == 2 and "--prompt-tokens" in proc.stderr
    # a RAM tier of 30 blocks spares the disk what it hits of the VRAM cache's misses (simulated: it
    # sees only those, so it is not independent of the VRAM cache); PCIe still carries them all
    ram = 30 * m.max_stride
    with_ram = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "0.5",
                         "--pcie-gbps", "10", "--ram-gib", str(ram / GIB))["plan"]
    ram_hit = with_ram["ram_hit_rate"]
    assert with_ram["ram_slots"] == 30 and 0.2 < ram_hit < 30 / (n_total - 20)  # at most: the tiers disjoint
    assert with_ram["disk_bytes_per_token"] == pytest.approx((1 - with_ram["hit_rate"]) * (1 - ram_hit)
                                                              * sum(k * l.stride for l in m.layers))
    assert with_ram["pcie_bytes_per_token"] == pytest.approx((1 - with_ram["hit_rate"])
                                                              * sum(k * l.payload_bytes for l in m.layers))
    assert "simulated" in with_ram["hit_rate_from"]
    # a cache too small for one layer's top-k is refused, naming what took the memory
    proc = run_cli("plan", tiny_pack, "--vram-gib", str((trunk + slot) / GIB), "--reserve-gib", "0",
                   "--disk-gbps", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "top-" in proc.stderr


def test_a_model_that_fits_vram_and_the_kept_tier_pays_no_host_time_per_miss(tiny_pack: Path) -> None:
    """Issue 34: where the VRAM cache and the RAM-tier blocks expertd lets the worker keep hold every
    expert, the worker reads each once at start and no step waits for expertd: every miss is a RAM
    hit, the host term is 0, and a token takes compute plus the GPU's copies of its kept experts.
    One block fewer in the tier and the misses wait for expertd again."""
    m = Manifest.load(tiny_pack)
    slot = pack_slot_bytes(m)
    n_total = len(m.layers) * m.model.n_expert
    k = m.model.n_expert_used
    slots = n_total // 2 + 8
    vram = trunk_in_vram(tiny_pack) + slots * slot + 1000
    common = ["--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "0.5", "--pcie-gbps", "10",
              "--compute-tok-s", "400", "--miss-host-ms", "0.5"]
    got = plan_json(tiny_pack, *common, "--ram-gib", str(n_total * m.max_stride / GIB))["plan"]
    # expertd's defaults: a hold share of half this tier, the rest kept, less a sixteenth (at least one)
    keeps = n_total - max(16, n_total // 2)
    assert got["keep_slots"] == keeps - max(1, keeps // 16) and slots + got["keep_slots"] >= n_total
    assert got["kept_all"] and got["ram_hit_rate"] == 1.0 and got["host_s"] == 0 and got["disk_bytes_per_token"] == 0
    payload = (1 - got["hit_rate"]) * sum(k * l.payload_bytes for l in m.layers)
    assert got["pcie_bytes_per_token"] == pytest.approx(payload) and payload > 0
    assert got["tok_s_today"] == pytest.approx(1 / (1 / 400 + payload / 10e9))
    assert got["tok_s_overlapped"] == pytest.approx(1 / max(1 / 400, payload / 10e9))
    short = max(r for r in range(n_total) if slots + _keep_slots(r) < n_total)  # the largest tier that falls short
    fewer = plan_json(tiny_pack, *common, "--ram-gib", str((short + 0.5) * m.max_stride / GIB))["plan"]
    assert fewer["ram_slots"] == short
    assert not fewer["kept_all"] and fewer["host_s"] > 0 and fewer["ram_hit_rate"] < 1.0


def test_the_disk_is_measured_with_o_direct(tiny_pack: Path) -> None:
    got = plan_json(tiny_pack, "--vram-gib", "2")
    assert got["inputs"]["disk_gbps"] > 0 and got["inputs"]["sources"]["disk"].startswith("measured")
    # the whole pack fits: nothing is read, and with no compute given nothing bounds the speed
    assert got["plan"]["hit_rate"] == 1.0 and got["plan"]["tok_s_today"] is None
    assert got["plan"]["bound"].startswith("none")


def test_a_traces_hit_rate_is_the_policys_replay(tiny_pack: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "t.jsonl"
    run_cli("eval", tiny_pack, "--text", "the quick brown fox", "--greedy", "12", "--trace", trace_path, check=True)
    m = Manifest.load(tiny_pack)
    vram = trunk_in_vram(tiny_pack) + 10 * pack_slot_bytes(m)
    got = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "1",
                    "--trace", trace_path, "--ram-gib", str(6 * m.max_stride / GIB))
    want = replay(read_trace(trace_path), [10], policies=("in_use",))[0].hit_rate["in_use"]
    assert got["plan"]["slots"] == 10 and got["plan"]["hit_rate"] == pytest.approx(want)
    assert str(trace_path) in got["plan"]["hit_rate_from"]
    vram_hit, ram_hit = tiered_hit_rates(requests_of(read_trace(trace_path)), 10, 6)
    assert vram_hit == pytest.approx(want) and got["plan"]["ram_hit_rate"] == pytest.approx(ram_hit) and ram_hit > 0
    # projected onto twice the layers, each tier holds half the share: replayed so
    projected = plan_json(tiny_pack, "--vram-gib", str((vram + trunk_in_vram(tiny_pack)) / GIB), "--reserve-gib", "0",
                          "--disk-gbps", "1", "--trace", trace_path, "--ram-gib", str(12 * m.max_stride / GIB),
                          "--layers", str(2 * m.model.n_layer))["plan"]
    share = projected["slots"] / (2 * len(m.layers) * m.model.n_expert)
    scaled = round(projected["slots"] / 2), round(projected["ram_slots"] / 2)
    assert projected["ram_slots"] == 12 and share == pytest.approx(scaled[0] / (len(m.layers) * m.model.n_expert), rel=0.1)
    assert (projected["hit_rate"], projected["ram_hit_rate"]) == pytest.approx(
        tiered_hit_rates(requests_of(read_trace(trace_path)), *scaled))


def test_a_truncated_pack_projects_onto_the_whole_model(tiny_pack: Path) -> None:
    """--layers N: expert bytes per token, experts to cache and compute per token grow by the MoE
    layers; the trunk by its MoE layers' tensors, its other tensors as they are."""
    m = Manifest.load(tiny_pack)
    moe, dense = len(m.layers), m.model.n_layer - len(m.layers)
    n = 3 * m.model.n_layer
    base = plan_json(tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--ram-gib", "0", "--compute-tok-s", "300")
    got = plan_json(tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--ram-gib", "0", "--compute-tok-s", "300",
                    "--layers", str(n), "--prefill-tok-s", "900")
    i, b = got["inputs"], base["inputs"]
    n_moe = n - dense
    assert i["n_moe_layers"] == n_moe and i["pack_moe_layers"] == moe
    assert i["block_bytes_per_token"] == b["block_bytes_per_token"] * n_moe // moe
    assert i["payload_bytes_per_token"] == b["payload_bytes_per_token"] * n_moe // moe
    tensors = open_source(tiny_pack / m.trunk.file).tensors
    moe_layer_bytes = sum(t.nbytes for t in tensors if t.name.startswith("blk.") and int(t.name.split(".")[1]) in
                          m.model.moe_layers)
    embedding = sum(t.nbytes for t in tensors if t.name.startswith("token_embd."))
    assert i["trunk_bytes"] == m.trunk.size_bytes - embedding - moe_layer_bytes + moe_layer_bytes * n_moe // moe
    # compute time grows with what a decode step reads: the trunk less its embedding table, the top-k experts
    read = lambda inputs: inputs["trunk_bytes"] + inputs["payload_bytes_per_token"]
    assert i["compute_tok_s"] == pytest.approx(300 * read(b) / read(i))
    assert 300 / 3 < i["compute_tok_s"] < 300 * m.model.n_layer / n * 1.5  # under 3x the layers, not by 3x
    assert i["prefill_tok_s"] == pytest.approx(900 / 3)  # a prompt's compute: by the layers that run it
    assert got["plan"]["share_of_experts"] == pytest.approx(got["plan"]["slots"] / (n_moe * m.model.n_expert))
    assert "--layers" in i["sources"]["layers"]
    proc = run_cli("plan", tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--layers", "4", "--write", "x")
    assert proc.returncode == 2 and "--layers" in proc.stderr


def test_the_configs_it_writes_are_read_by_the_worker_and_the_daemon(tiny_pack: Path, tmp_path: Path) -> None:
    proc = run_cli("plan", tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--write", tmp_path / "etc")
    assert proc.returncode == 0, proc.stderr
    worker = worker_main.settings(["--config", str(tmp_path / "etc" / "worker.toml")])
    assert Path(worker.pack) == tiny_pack.resolve() and worker.cache_vram_mib > 0
    daemon = load_config(tmp_path / "etc" / "expertd.toml", argparse.Namespace())
    assert Path(daemon.pack) == tiny_pack.resolve() and daemon.stage_slots >= 64
    assert daemon.ram_cache_gib is not None and daemon.ram_cache_gib >= 0
