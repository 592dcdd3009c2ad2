"""The one `expertpack` entry point (expertpack.cli.main), called in this process: its help lists every
verb, each verb's help is its own, the verbs whose code lives in other packages (plan, bench) are
reached, and a bad command line fails with one line and exit status 2."""

from __future__ import annotations

import argparse

import pytest

from expertpack.cli.main import main

VERBS = ("build", "verify", "inspect", "synth", "eval", "bench", "plan")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr); argparse's --help and usage errors exit."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and out.startswith("usage: expertpack ")
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()}
    assert set(VERBS) <= listed, out


@pytest.mark.parametrize("argv", [(verb,) for verb in VERBS if verb not in ("bench", "plan")]
                         + [("bench",), ("bench", "io"), ("bench", "serve"), ("bench", "cache"), ("plan",)])
def test_each_verb_has_its_own_help(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    code, out, err = run(capsys, *argv, "--help")
    assert code == 0, err
    assert out.startswith("usage: expertpack " + " ".join(argv)), out


def test_a_bad_command_line_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "synth", "--list", "--seed", "-1")
    assert code == 2 and err == "expertpack synth: --seed must lie in 0..9,223,372,036,854,775,807, got -1\n"
    code, _, err = run(capsys, "eval", "model.gguf", "--text", "hi", "--top-p", "nan")
    assert code == 2 and err == "expertpack eval: --top-p must lie in 0..1, got nan\n"
    code, _, err = run(capsys, "bench", "nope")
    assert code == 2 and "invalid choice: 'nope'" in err


@pytest.mark.parametrize("flags,needle", [
    (("--top-p", "0"), "--top-p must lie above 0"),
    (("--device", "cuda:999999999999999999999"), "--device 'cuda:999999999999999999999': no such device"),
    (("--device", "cuda:1" + "0" * 5000), "no such device"),
])
def test_eval_refuses_what_it_cannot_sample_with_or_run_on_in_one_line(capsys: pytest.CaptureFixture[str],
                                                                       flags: tuple[str, ...], needle: str) -> None:
    """They were tracebacks (the sampler's ValueError, torch's overflow of a device index), raised
    before the model loads: model.gguf need not exist."""
    code, _, err = run(capsys, "eval", "model.gguf", "--text", "hi", *flags)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("expertpack eval: "), err
    assert needle in err and len(err) < 300, err


def documented_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every verb's parser that a user reads flag by flag: the offline verbs, eval, bench io, plan."""
    from expertpack.bench import bench_io
    from expertpack.cli.main import parser
    from expertpack.planner import plan

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    verbs = {name: p for name, p in sub.choices.items() if name not in ("bench", "plan")}
    return {**verbs, "bench io": bench_io.parser(), "plan": plan.parser()}


@pytest.mark.parametrize("verb", ["build", "verify", "inspect", "synth", "eval", "bench io", "plan"])
def test_every_flag_says_what_it_does_and_its_default(verb: str) -> None:
    p = documented_parsers()[verb]
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"expertpack {verb} {name} has no help"
        if action.default not in (None, False):
            assert "default" in action.help, f"expertpack {verb} {name}: its default {action.default!r} is not said"
    text = p.format_help()
    assert "%%" not in text and "%(" not in text, text


def test_plan_help_speaks_of_what_the_user_gives_and_gets() -> None:
    text = documented_parsers()["plan"].format_help()
    assert ".py" not in text and "issue" not in text, text  # no source files, no project history
    assert "examples:" in text and "expertpack plan model.pack" in text
