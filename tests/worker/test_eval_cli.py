"""`expertpack eval` as users and tools call it: on a source GGUF and on a pack, with token ids or
text, printing the continuation and saving the prompt logits; and with --daemon, the experts coming
from a real expertd through the cache, with the same tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ..conftest import FIXTURES, Daemon, run_cli, start_daemon
from ..helpers.engine import assert_every_key_accounted, damage_layer


def test_eval_greedy_matches_the_reference_and_saves_logits(tmp_path: Path) -> None:
    model = FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.BF16.gguf"
    hf = json.loads((FIXTURES / "ref" / "qwen3moe-a" / "hf_ref.json").read_text())
    prompt = np.load(FIXTURES / "ref" / "qwen3moe-a" / "prompt_ids.npy").tolist()
    out = tmp_path / "logits.npy"
    proc = run_cli("eval", model, "--tokens", ",".join(map(str, prompt)), "--greedy", "16", "--save-logits", out,
                   "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["continuation"] == hf["hf_greedy_next_tokens"]
    logits = np.load(out)
    assert logits.shape == (len(prompt), 2048) and logits.dtype == np.float32
    want = np.load(FIXTURES / "ref" / "qwen3moe-a" / "hf_logits_f32.npy")[:len(prompt)]
    assert np.abs(logits - want).max() < 1e-4


def test_eval_on_a_pack_with_text(fixture_packs: dict[str, tuple[Path, Path]]) -> None:
    _, pack = fixture_packs["mixtral-a.Q4_K_M"]
    proc = run_cli("eval", pack, "--text", "Hello world, this is", "--greedy", "5")
    assert proc.returncode == 0, proc.stderr
    assert "continuation (5 tokens)" in proc.stdout and "prompt (" in proc.stdout


def test_eval_samples_a_vanishing_temperature_or_top_p_greedily(capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature 1e-300 (and a top-p below 1/vocab) sample exactly what greedy chooses; they
    were a traceback ("probability tensor contains either inf, nan"). In this process: no torch to
    start for each run."""
    from expertpack.cli.main import main

    model = FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q2_K.gguf"
    runs = {}
    for name, flags in {"greedy": (), "tiny temperature": ("--temperature", "1e-300"),
                        "tiny top-p": ("--temperature", "1", "--top-p", "5e-324")}.items():
        assert main(["eval", str(model), "--tokens", "1,2,3", "--greedy", "4", "--json", *flags]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["continuation"]
    assert runs["tiny temperature"] == runs["tiny top-p"] == runs["greedy"], runs


def test_eval_refuses_bad_tokens() -> None:
    model = FIXTURES / "gguf" / "qwen3moe-a" / "qwen3moe-a.Q2_K.gguf"
    for tokens in ("1,two,3", "1,99999"):
        proc = run_cli("eval", model, "--tokens", tokens)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr and "eval" in proc.stderr


def test_eval_through_expertd_gives_the_same_tokens(tiny_pack: Path, daemon: Daemon) -> None:
    tokens = ",".join(str(t) for t in range(40, 72))
    direct = run_cli("eval", tiny_pack, "--tokens", tokens, "--greedy", "8", "--json", check=True)
    served = run_cli("eval", tiny_pack, "--tokens", tokens, "--greedy", "8", "--json", "--daemon", daemon.endpoint,
                     "--cache-vram-mib", "1", check=True)
    a, b = json.loads(direct.stdout), json.loads(served.stdout)
    assert b["continuation"] == a["continuation"]
    cache = b["expert_cache"]["cache"]
    assert cache["slots"] == 9 and cache["misses"] > cache["slots"] and cache["evictions"] > 0  # 1 MiB / 110,592 B
    daemon_counters = b["expert_cache"]["daemon"]
    try:
        assert_every_key_accounted(cache, daemon_counters)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{served.stderr[-4000:]}") from None

    too_small = run_cli("eval", tiny_pack, "--tokens", tokens, "--daemon", daemon.endpoint, "--cache-vram-mib", "0")
    assert too_small.returncode != 0 and "one layer can select 4" in too_small.stderr
    assert "Traceback" not in too_small.stderr


def test_eval_through_expertd_says_in_one_line_when_a_block_cannot_be_read(tiny_pack: Path, tmp_path: Path) -> None:
    """Issue 37: a block expertd failed mid-run (here CORRUPT: every block of the last layer damaged
    on disk, so the first layers ran) was a traceback; it is one line naming the block, exit 2."""
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    layer = damage_layer(pack, -1)
    daemon = start_daemon(pack, tmp_path)
    try:
        daemon.wait_for("READY=1")
        proc = run_cli("eval", pack, "--tokens", "40,41,42", "--greedy", "2", "--daemon", daemon.endpoint,
                       "--cache-vram-mib", "1")
    finally:
        daemon.stop()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("expertpack eval: expert storage failed mid-run: ") and f"layer {layer}" in last, last
