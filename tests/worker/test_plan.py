"""`expertpack plan`: its arithmetic on a real pack (cache slots, hit rate, bytes per token, the
two tok/s figures and the bound), its disk probe (O_DIRECT on the pack's own file), a routing trace's hit rate equal to `bench cache`'s replay of the same policy,
and the config files it writes read back by the worker and the daemon."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from expertpack.worker.cache_replay import pack_slot_bytes, replay
from expertpack.daemon.config import load_config
from expertpack.packtools.layout import Manifest
from expertpack.worker import main as worker_main
from expertpack.worker.routing_trace import read_trace

from ..conftest import run_cli

GIB = 1 << 30


def plan_json(*args: str | Path) -> dict:
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_arithmetic_on_a_pack(tiny_pack: Path) -> None:
    m = Manifest.load(tiny_pack)
    slot = pack_slot_bytes(m)
    trunk = m.trunk.size_bytes
    vram = trunk + 20 * slot + 1000  # twenty slots' worth once the trunk is in
    got = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "0.5",
                    "--pcie-gbps", "10", "--compute-tok-s", "400")
    p, i = got["plan"], got["inputs"]
    n_total = len(m.layers) * m.model.n_expert
    k = m.model.n_expert_used
    assert p["slots"] == 20 and p["share_of_experts"] == pytest.approx(20 / n_total)
    assert p["hit_rate"] == pytest.approx(20 / n_total)  # uniform routing
    blocks = (1 - 20 / n_total) * sum(k * l.stride for l in m.layers)
    payload = (1 - 20 / n_total) * sum(k * l.payload_bytes for l in m.layers)
    assert p["disk_bytes_per_token"] == pytest.approx(blocks) and p["pcie_bytes_per_token"] == pytest.approx(payload)
    disk_s, pcie_s, compute_s = blocks / 0.5e9, payload / 10e9, 1 / 400
    assert p["tok_s_today"] == pytest.approx(1 / (compute_s + max(disk_s, pcie_s)))
    assert p["tok_s_overlapped"] == pytest.approx(1 / max(disk_s, pcie_s, compute_s))
    assert p["bound"] == max({"disk": disk_s, "pcie": pcie_s, "compute": compute_s}.items(), key=lambda kv: kv[1])[0]
    assert i["sources"]["disk"] == "--disk-gbps" and i["trunk_bytes"] == trunk
    # a cache too small for one layer's top-k is refused, naming what took the memory
    proc = run_cli("plan", tiny_pack, "--vram-gib", str((trunk + slot) / GIB), "--reserve-gib", "0",
                   "--disk-gbps", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "top-" in proc.stderr


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
    vram = m.trunk.size_bytes + 10 * pack_slot_bytes(m)
    got = plan_json(tiny_pack, "--vram-gib", str(vram / GIB), "--reserve-gib", "0", "--disk-gbps", "1",
                    "--trace", trace_path)
    want = replay(read_trace(trace_path), [10], policies=("in_use",))[0].hit_rate["in_use"]
    assert got["plan"]["slots"] == 10 and got["plan"]["hit_rate"] == pytest.approx(want)
    assert str(trace_path) in got["plan"]["hit_rate_from"]


def test_the_configs_it_writes_are_read_by_the_worker_and_the_daemon(tiny_pack: Path, tmp_path: Path) -> None:
    proc = run_cli("plan", tiny_pack, "--vram-gib", "2", "--disk-gbps", "1", "--write", tmp_path / "etc")
    assert proc.returncode == 0, proc.stderr
    worker = worker_main.settings(["--config", str(tmp_path / "etc" / "worker.toml")])
    assert Path(worker.pack) == tiny_pack.resolve() and worker.cache_vram_mib > 0
    daemon = load_config(tmp_path / "etc" / "expertd.toml", argparse.Namespace())
    assert Path(daemon.pack) == tiny_pack.resolve() and daemon.stage_slots >= 64
