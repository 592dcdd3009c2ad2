"""Routing traces: recording changes no logit and no token; the file holds every token's experts in
every MoE layer (prompt and decode), the same ids the model routed, one line per layer call; the
reader drops a torn last line and names any other bad line; `expert-worker --trace` records what
its clients asked for (not its warm-up) and closes the file on SIGTERM."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertpack.worker.engine.engine import Engine
from expertpack.worker.engine.sampling import Sampler
from expertpack.worker.experts.routing_trace import FORMAT, TraceError, read_trace, start_trace, stop_trace

from ..conftest import start_daemon

PROMPT = [5, 77, 300, 12, 9, 1500, 42]


@pytest.fixture(scope="module")
def engine(tiny_gguf: Path) -> Engine:
    return Engine.load(tiny_gguf)


def test_recording_changes_nothing_and_holds_what_the_model_routed(engine: Engine, tmp_path: Path) -> None:
    plain_tokens, plain_logits = engine.generate(PROMPT, 6, Sampler(temperature=1.0, seed=2))
    engine.model.moe.routing_log = {}  # ExpertFFN's own log, for comparison
    engine.generate(PROMPT, 6, Sampler(temperature=1.0, seed=2))
    log, engine.model.moe.routing_log = engine.model.moe.routing_log, None

    writer = start_trace(engine, tmp_path / "t.jsonl", model="tiny")
    traced_tokens, traced_logits = engine.generate(PROMPT, 6, Sampler(temperature=1.0, seed=2))
    stop_trace(engine, writer)
    assert engine.model.moe.routing_log is None
    assert traced_tokens == plain_tokens
    assert torch.equal(traced_logits, plain_logits)

    trace = read_trace(tmp_path / "t.jsonl")
    h = trace.header
    assert (h.arch, h.n_expert, h.n_expert_used, h.moe_layers, h.model) == ("qwen3moe", 16, 4, (0, 1, 2, 3), "tiny")
    # one prompt pass, then a pass per generated token but the last (which is returned, not run)
    assert trace.n_steps == 6 and trace.n_tokens == len(PROMPT) + 5 and not trace.truncated
    assert [(c.step, c.layer) for c in trace.calls] == [(s, l) for s in range(6) for l in range(4)]
    assert trace.calls[0].ids.shape == (len(PROMPT), 4) and all(len(c.ids) == 1 for c in trace.calls[4:])
    for layer in range(4):
        recorded = [c.ids for c in trace.calls if c.layer == layer]
        assert len(recorded) == len(log[layer])
        for ours, theirs in zip(recorded, log[layer]):
            assert np.array_equal(ours, theirs.numpy())


def write_lines(path: Path, *lines: str, end: str = "\n") -> Path:
    path.write_text("\n".join(lines) + end)
    return path


HEADER = json.dumps({"format": FORMAT, "version": 1, "arch": "qwen3moe", "n_layer": 3, "n_expert": 8,
                     "n_expert_used": 2, "moe_layers": [1, 2], "fingerprint": None, "model": "m"})


def test_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", HEADER, "[0,1,[[0,1],[2,3]]]", "[0,2,[[4,5],[6,7]]]", "[1,1,[[0,",
                       end="")
    trace = read_trace(path)
    assert trace.truncated and len(trace.calls) == 2 and trace.n_tokens == 2
    assert trace.calls[1].ids.tolist() == [[4, 5], [6, 7]]


@pytest.mark.parametrize("line, needle", [
    ("[0,0,[[0,1]]]", "layer 0 is not among"),
    ("[0,1,[[0,8]]]", "0..7"),
    ("[0,1,[[0,1,2]]]", "[T, 2]"),
    ("[0,1,[]]", "[T, 2]"),
    ("{\"step\": 0}", "not a [step, layer, ids] record"),
    ("[0,1,[[0,", "not a [step, layer, ids] record"),  # torn, but not the last line
])
def test_bad_lines_are_named(tmp_path: Path, line: str, needle: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", HEADER, "[0,1,[[0,1]]]", line, "[1,1,[[0,1]]]")
    with pytest.raises(TraceError, match=r"t\.jsonl:3: .*" + needle.replace("[", r"\[").replace("]", r"\]")):
        read_trace(path)


def test_other_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a routing trace"):
        read_trace(write_lines(tmp_path / "a", '{"format": "something else"}'))
    with pytest.raises(TraceError, match="empty"):
        read_trace(write_lines(tmp_path / "b", "", end=""))
    with pytest.raises(TraceError, match="version 2"):
        read_trace(write_lines(tmp_path / "c", HEADER.replace('"version":1', '"version":2').replace(
            '"version": 1', '"version": 2')))


@pytest.mark.slow
def test_expert_worker_records_its_requests(tmp_path: Path) -> None:
    from expertpack.packtools.build import BuildOptions, build_pack

    from ..conftest import FIXTURES
    from ..helpers.worker import PACK, start_worker

    pack = tmp_path / "pack"
    build_pack(FIXTURES / "gguf/qwen3moe-a" / f"{PACK}.gguf", pack, BuildOptions(progress=False, safety_margin_bytes=0))
    daemon = start_daemon(pack, tmp_path, "--client-slots", "4")
    daemon.wait_for("READY=1")
    path = tmp_path / "served.jsonl"
    try:
        worker = start_worker(pack, daemon.endpoint, tmp_path, "--trace", str(path))
        try:
            got = worker.client().completions.create(model="fixture", prompt="Once upon a time", max_tokens=9,
                                                     temperature=0, extra_body={"ignore_eos": True})
            again = worker.client().completions.create(model="fixture", prompt="Hi", max_tokens=3, temperature=0,
                                                       extra_body={"ignore_eos": True})
        finally:
            assert worker.stop() == 0, worker.log
        assert "routing trace: " in worker.log
    finally:
        assert daemon.stop()[0] == 0
    trace = read_trace(path)
    assert not trace.truncated and trace.header.fingerprint is not None
    # each request: its prompt in one pass, then one pass per generated token but the last
    want = sum(r.usage.prompt_tokens + r.usage.completion_tokens - 1 for r in (got, again))
    assert trace.n_tokens == want, (trace.n_tokens, got.usage, again.usage)


def test_a_trace_file_in_a_missing_directory_is_refused_up_front(tmp_path: Path) -> None:
    import subprocess

    from ..conftest import BIN

    proc = subprocess.run([str(BIN / "expert-worker"), "--pack", str(tmp_path), "--trace",
                           str(tmp_path / "nowhere" / "t.jsonl")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "trace" in proc.stderr and "does not exist" in proc.stderr


def test_a_trace_replaces_no_file_unless_told_and_never_the_models_own(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--trace FILE` (expert-worker and expertpack eval) refuses a FILE that exists unless
    --trace-overwrite says so, and the served model's own files even then, by whatever path they
    are named: one line, exit 2, the file untouched. Both refuse before loading anything, so the
    pack here is three placeholder files (and eval is called in this process)."""
    import subprocess

    from expertpack.cli.main import main as expertpack
    from expertpack.worker.serve.main import settings

    from ..conftest import BIN

    pack, gguf = tmp_path / "pack", tmp_path / "model.gguf"
    pack.mkdir()
    precious = {pack / name: f"the pack's {name}" for name in ("experts.pack", "manifest.json", "trunk.gguf")}
    precious[gguf] = "a model"
    precious[tmp_path / "old.jsonl"] = "an earlier trace"
    for path, text in precious.items():
        path.write_text(text)
    (tmp_path / "link").symlink_to(pack / "experts.pack")
    cases = [  # (model, trace, forced, what the line says)
        (pack, pack / "experts.pack", False, "is experts.pack of the model ("),
        (pack, pack / "manifest.json", True, "is manifest.json of the model ("),
        (pack, tmp_path / "link", True, "is experts.pack of the model ("),
        (pack, pack / ".." / "pack" / "trunk.gguf", True, "is trunk.gguf of the model ("),
        (gguf, gguf, True, "is model.gguf of the model ("),
        (pack, tmp_path / "old.jsonl", False, "exists; --trace-overwrite replaces it"),
    ]
    for model, trace, forced, needle in cases:
        force = ["--trace-overwrite"] if forced else []
        if model.is_dir():
            proc = subprocess.run([str(BIN / "expert-worker"), "--pack", str(model), "--trace", str(trace), *force],
                                  capture_output=True, text=True, timeout=60)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (trace, proc.stderr)
        try:
            code = expertpack(["eval", str(model), "--tokens", "1", "--trace", str(trace), *force])
        except SystemExit as exc:
            code = exc.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], (trace, lines)
    assert {path: path.read_text() for path in precious} == precious
    assert settings(["--pack", str(pack), "--trace", str(tmp_path / "old.jsonl"), "--trace-overwrite"]).trace_overwrite


def test_eval_stepwise_traces_the_prompt_one_token_per_pass(tiny_gguf: Path, tmp_path: Path) -> None:
    """`expertpack eval --stepwise --trace`: the prompt fed as decoding feeds it, one token per
    pass, gives the same continuation and prompt logits within rounding as one pass."""
    from ..conftest import run_cli

    ids = ",".join(map(str, PROMPT))
    whole = run_cli("eval", tiny_gguf, "--tokens", ids, "--greedy", "4", "--json", "--save-logits",
                    tmp_path / "whole.npy", check=True)
    steps = run_cli("eval", tiny_gguf, "--tokens", ids, "--greedy", "4", "--json", "--save-logits",
                    tmp_path / "steps.npy", "--stepwise", "--trace", tmp_path / "t.jsonl", check=True)
    assert json.loads(steps.stdout)["continuation"] == json.loads(whole.stdout)["continuation"]
    a, b = np.load(tmp_path / "whole.npy"), np.load(tmp_path / "steps.npy")
    assert a.shape == b.shape == (len(PROMPT), 2048)
    assert np.abs(a - b).max() < 1e-3 * np.abs(a).max(), np.abs(a - b).max()
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.n_steps == len(PROMPT) + 3 == trace.n_tokens
    assert all(len(c.ids) == 1 for c in trace.calls)
