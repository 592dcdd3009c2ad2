"""Batched decode steps against each sequence run alone: the scenarios and the runs that
tests/worker/test_batched_decode.py and tests/gpu/test_batched_decode_cuda.py compare."""

from __future__ import annotations

import torch

from expertpack.worker.engine.arena import Sequence
from expertpack.worker.engine.engine import Engine

MODELS = {
    "qwen3moe": "gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf",
    "mixtral": "gguf/mixtral-a/mixtral-a.Q4_K_M.gguf",
    "gpt-oss": "gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf",
    "deepseek4": "flagship/deepseek4/dsv4-tiny.Q2_K.gguf",  # compressed attention, hash layers, hyper-connections
}
PROMPTS = {"a": [1, 5, 9, 200, 33, 17], "b": [4, 81, 2, 77, 300, 12, 8, 64, 3, 5, 19], "c": [250, 6],
           "d": [7, 7, 1000, 42], "e": [42]}
# name -> (the batched step at which it joins, after its prefill; its decode steps): b and c join
# together (a mixed step: both prompts beside a's token), a leaves after step 5 and d takes its slot
# at step 7. Triton's interpreter takes ~5 s a token of these models
# (prompt tokens too, up to 8): the kernels' run is one step of two rows at different positions.
SCENARIOS = {"torch": {"a": (0, 6), "b": (2, 8), "c": (2, 5), "d": (7, 4)}, "kernels": {"c": (0, 1), "e": (0, 1)}}


def eager_step(engine: Engine, seq: Sequence, token: int) -> torch.Tensor:
    """One sequence's own decode step, eager (the reference a batched row is held to)."""
    with torch.inference_mode(), engine.place.running():
        ids = torch.tensor([token], dtype=torch.int64, device=engine.device)
        return engine.model.forward(ids, seq.kv).to(torch.float32)[0]


def prefill(engine: Engine, seq: Sequence, prompt: list[int]) -> int:
    with torch.inference_mode(), engine.place.running():
        ids = torch.tensor(prompt, dtype=torch.int64, device=engine.device)
        return int(engine.model.forward(ids, seq.kv).to(torch.float32)[-1].argmax())


def alone(engine: Engine, name: str, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    with engine.new_sequence() as seq:
        token = prefill(engine, seq, PROMPTS[name])
        tokens, logits = [token], []
        for _ in range(steps):
            logits.append(eager_step(engine, seq, tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def batched(engine: Engine, scenario: dict[str, tuple[int, int]], mixed: bool = False
            ) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """The scenario's sequences in batched steps; with `mixed`, the newcomers' prompts run in one step
    with the running sequences' next tokens (Engine.mixed_step) where any run, as expert-worker's
    scheduler runs them."""
    running: dict[str, Sequence] = {}
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    step = 0

    def took(names: list[str], rows: torch.Tensor) -> None:
        for name, row in zip(names, rows):
            tokens, logits = out[name]
            logits.append(row)
            tokens.append(int(row.argmax()))
            if len(logits) == scenario[name][1]:
                running.pop(name).close()  # done: its slot goes back (d takes a's)

    while len(out) < len(scenario) or running:
        stepped = False
        joining = {name: engine.new_sequence() for name, (at, _) in scenario.items() if at == step}
        names = list(running)
        if mixed and names and joining:
            rows = engine.mixed_step([(seq, PROMPTS[name]) for name, seq in joining.items()],
                                     [running[n] for n in names], [out[n][0][-1] for n in names])
            for name, row in zip(joining, rows):
                out[name] = ([int(row.argmax())], [])
            took(names, rows[len(joining):])
            stepped = True
        else:
            for name, seq in joining.items():
                out[name] = ([prefill(engine, seq, PROMPTS[name])], [])
        running.update(joining)
        if running and not stepped:
            names = list(running)
            took(names, engine.decode_batch([running[n] for n in names], [out[n][0][-1] for n in names]))
        step += 1
    return out
