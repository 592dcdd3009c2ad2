"""`expertpack bench serve --endpoint URL`: the reference serving protocol, replayed against any
OpenAI-compatible server (expert-worker, llama.cpp's llama-server, ...), so one run compares systems.

Ten fixed chat requests, one at a time by default: five instruction prompts in the Alpaca style and
five MMLU-style multiple-choice questions; temperature 0 and exactly --max-tokens completion tokens
(`ignore_eos`, which llama-server and vLLM also honour). Each request is streamed: prefill and
decode rates come from the server's `timings` when it reports them (llama-server, expert-worker),
else from the client's clock (time to first token; the rest). `--concurrency N` keeps N requests of a
set in flight, as N users would (llama-server `-np N`); `--repeat R` sends each set's prompts R
times, so that N in flight stay busy past a set's five. Each set also reports its aggregate decode
rate (all its completion tokens over its wall time) and the time to first token on the client's
clock, which counts the time a request waits in the server's queue: what a user waits. The unique-key hit rate and the expert
bytes fetched (from expertd's RAM tier or pack) come from expert-worker's `expertpack` object (n/a elsewhere). Prints a table per set and
writes bench-serve.json and bench-serve.png (matplotlib) into --out.

`--compare A.json B.json ...` draws earlier runs side by side instead (expert-worker's,
llama-server's, ...): one table, one chart (bench-serve-compare.png), "n/a" where a server reported
no hit rate."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from statistics import mean
from typing import Sequence

INSTRUCTIONS = [
    "Write a short summary of the plot of the animated film \"Toy Story\".",
    "Suggest a fun activity for two children that needs only a pencil, some paper and a few markers.",
    "Translate the following Spanish sentence into English: \"El sol no brilla hoy.\"",
    "Give one concrete example of how an AI algorithm can end up biased, and say where the bias comes from.",
    "Design a restaurant dish that uses salmon, avocado and spinach. Describe how it is cooked and plated.",
]
MULTIPLE_CHOICE = [
    "What is the maximum order of an element of the symmetric group S_10?\n"
    "A. 6\nB. 12\nC. 30\nD. 105\nAnswer with the letter of the correct option.",
    "In Garrett Hardin's work on population and the environment, what does the 'ratchet effect' describe?\n"
    "A. Aid that lets a population grow past its carrying capacity, so that the next crisis is larger\n"
    "B. The gradual rise of prices under inflation\nC. Technology that steadily lowers birth rates\n"
    "D. A treaty mechanism that can only tighten emission limits\nAnswer with the letter of the correct option.",
    "When a government borrows heavily to finance a deficit, which effect on private investment is the "
    "'crowding-out' effect?\nA. Private investment rises because demand is higher\nB. Private investment "
    "falls because interest rates rise\nC. Private investment is unaffected because savings adjust\n"
    "D. Private investment rises because taxes fall\nAnswer with the letter of the correct option.",
    "A landowner excavates close to the boundary of her lot, and the neighbour's land, in its natural state, "
    "subsides into the pit. Under the common-law right of lateral support, what is the landowner's "
    "liability?\nA. None, unless she was negligent\nB. Strict liability for the subsidence of the land in its "
    "natural state\nC. Liability only for damage to buildings\nD. Liability only if she used explosives\n"
    "Answer with the letter of the correct option.",
    "Which is the strongest argument against the claim of ethical relativists that universal human rights "
    "are a form of cultural imperialism?\nA. Every culture already agrees on all rights\nB. Relativism "
    "itself asserts a universal norm of tolerance, so it cannot consistently reject all universal norms\n"
    "C. Human rights are older than any culture\nD. Cultures never change\nAnswer with the letter of the "
    "correct option.",
]
SETS = {"instruction": INSTRUCTIONS, "multiple-choice": MULTIPLE_CHOICE}


@dataclass
class Result:
    set: str
    index: int
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    rates_from: str  # "server" (its timings) or "client" (time to first token, then the rest)
    hit_rate: float | None
    fetched_bytes: int | None
    seconds: float
    started_s: float  # when it was sent, since its set's first request was: the set's wall time ends at the last
    ttft_s: float  # sent to first content token, client clock: queueing in the server included


class ServeError(RuntimeError):
    pass


def _post_stream(url: str, body: dict, api_key: str | None, timeout: float) -> tuple[list[dict], float, float | None]:
    """The streamed chunks, the request's wall time, and the time of its first content token."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    start, first = time.perf_counter(), None
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServeError(f"the server failed the request: {chunk['error'].get('message')}")
                chunks.append(chunk)
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        raise ServeError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as exc:
        raise ServeError(f"{url}: {exc.reason}; is the server running?") from None
    return chunks, time.perf_counter() - start, first


def run_one(base: str, model: str, set_name: str, index: int, prompt: str, max_tokens: int, api_key: str | None,
            timeout: float, set_start: float) -> Result:
    """One streamed request; `set_start` (a perf_counter reading) places it in its set's wall time."""
    started_s = time.perf_counter() - set_start
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks, seconds, first = _post_stream(f"{base}/chat/completions", body, api_key, timeout)
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    if usage is None:
        raise ServeError("the server sent no usage (stream_options.include_usage); cannot count tokens")
    timings = next((c["timings"] for c in reversed(chunks) if c.get("timings")), None)
    extra = next((c["expertpack"] for c in reversed(chunks) if c.get("expertpack")), None)
    n_prompt, n_done = usage["prompt_tokens"], usage["completion_tokens"]
    first = first or seconds  # no content at all: the user had nothing before the end
    if timings:
        prefill, decode, source = timings["prompt_per_second"], timings["predicted_per_second"], "server"
    else:
        prefill = n_prompt / first
        decode = (n_done - 1) / (seconds - first) if n_done > 1 and seconds > first else 0.0
        source = "client"
    return Result(set_name, index, n_prompt, n_done, prefill, decode, source,
                  extra and extra.get("hit_rate"), extra and extra.get("fetched_bytes"), seconds, started_s, first)


def run_set(base: str, model: str, set_name: str, prompts: list[str], max_tokens: int, api_key: str | None,
            timeout: float, concurrency: int) -> list[Result]:
    """A set's requests, `concurrency` in flight: that many threads each send the next request once
    their last one is answered, as that many users would; one thread is the sequential protocol.
    Results in prompt order."""
    set_start = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-serve") as pool:
        futures = [pool.submit(run_one, base, model, set_name, i, prompt, max_tokens, api_key, timeout, set_start)
                   for i, prompt in enumerate(prompts)]
        try:
            for future in as_completed(futures):
                r = future.result()
                print(f"{set_name} {r.index + 1}/{len(prompts)}: {r.prompt_tokens} + {r.completion_tokens} tokens, "
                      f"prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.2f} tok/s "
                      f"({r.rates_from}), first token after {r.ttft_s:.3f} s", file=sys.stderr)
                if r.completion_tokens != max_tokens:
                    print(f"  warning: {r.completion_tokens} completion tokens, not {max_tokens} (the server "
                          "may not honour ignore_eos)", file=sys.stderr)
                results.append(r)
        except BaseException:
            for future in futures:  # the requests not sent yet; those in flight end with their answers
                future.cancel()
            raise
    return sorted(results, key=lambda r: r.index)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1), interpolated linearly between the two nearest ranks (numpy's
    default), so that a set of five requests still has a p90 between its two slowest."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[Result]) -> dict[str, dict]:
    """Per set: per-request rates (their mean under the historical keys, then p50 and p90), the
    aggregate decode rate over the set's wall time (from its first send to its last answer: what a
    server does for all its users at once), and the time to first token."""
    out = {}
    for name in SETS:
        rs = [r for r in results if r.set == name]
        if not rs:
            continue
        hits = [r.hit_rate for r in rs if r.hit_rate is not None]
        fetched = [r.fetched_bytes / r.completion_tokens for r in rs if r.fetched_bytes is not None and r.completion_tokens]
        prefill, decode = [r.prefill_tokens_per_s for r in rs], [r.decode_tokens_per_s for r in rs]
        ttft = [r.ttft_s for r in rs]
        wall_s = max(r.started_s + r.seconds for r in rs) - min(r.started_s for r in rs)
        completion_tokens = sum(r.completion_tokens for r in rs)
        out[name] = {"requests": len(rs), "prefill_tokens_per_s": mean(prefill),
                     "decode_tokens_per_s": mean(decode),
                     "hit_rate": mean(hits) if hits else None,
                     "fetched_gb_per_token": mean(fetched) / 1e9 if fetched else None,
                     "completion_tokens": completion_tokens,
                     "wall_s": wall_s,
                     "aggregate_decode_tokens_per_s": completion_tokens / wall_s if wall_s > 0 else None,
                     "prefill_tokens_per_s_p50": percentile(prefill, 0.5),
                     "prefill_tokens_per_s_p90": percentile(prefill, 0.9),
                     "decode_tokens_per_s_p50": percentile(decode, 0.5),
                     "decode_tokens_per_s_p90": percentile(decode, 0.9),
                     "ttft_s_mean": mean(ttft), "ttft_s_p50": percentile(ttft, 0.5),
                     "ttft_s_p90": percentile(ttft, 0.9)}
    return out


def make_report(endpoint: str, model: str, label: str, max_tokens: int, results: list[Result],
                concurrency: int = 1, repeat: int = 1) -> dict:
    """What bench-serve.json holds."""
    return {"bench": "serve", "date": date.today().isoformat(), "endpoint": endpoint, "model": model,
            "label": label, "max_tokens": max_tokens, "concurrency": concurrency, "repeat": repeat,
            "summary": summarize(results), "requests": [asdict(r) for r in results]}


@dataclass(frozen=True)
class Run:
    """One bench-serve.json: a system's summary per set, under the name it was given."""
    label: str
    summary: dict[str, dict]
    conditions: dict  # endpoint, model, max_tokens, concurrency, date: what the report says besides

    @classmethod
    def from_report(cls, report: dict, fallback_label: str = "") -> "Run":
        # Reports from before --concurrency were all sent one request at a time.
        return cls(report.get("label") or report.get("model") or fallback_label, report["summary"],
                   {**{k: report.get(k) for k in ("endpoint", "model", "max_tokens", "date")},
                    "concurrency": report.get("concurrency", 1)})

    @classmethod
    def load(cls, path: Path) -> "Run":
        try:
            report = json.loads(path.read_text())
            return cls.from_report(report, path.stem)
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ServeError(f"{path}: not a bench-serve.json ({exc})") from None


def _fmt(v: float | None, pattern: str) -> str:
    return "n/a" if v is None else pattern.format(v)


def table(runs: list[Run]) -> str:
    """One row per set and run; per-request rates are means. Reports from before --concurrency have
    no aggregate rate or time to first token: n/a."""
    width = max([6, *(len(r.label) for r in runs)]) + 2
    lines = [f"{'system':<{width}}{'set':<17}{'concurrency':>12}{'requests':>9}{'prefill tok/s':>15}"
             f"{'decode tok/s':>14}{'aggregate tok/s':>17}{'TTFT mean s':>13}{'TTFT p90 s':>12}{'hit rate':>10}"
             f"{'fetched GB/token':>18}"]
    for name in SETS:
        for run in runs:
            s = run.summary.get(name)
            if s is None:
                continue
            lines.append(f"{run.label:<{width}}{name:<17}{run.conditions['concurrency']:>12}{s['requests']:>9}"
                         f"{s['prefill_tokens_per_s']:>15.2f}{s['decode_tokens_per_s']:>14.2f}"
                         f"{_fmt(s.get('aggregate_decode_tokens_per_s'), '{:.2f}'):>17}"
                         f"{_fmt(s.get('ttft_s_mean'), '{:.3f}'):>13}{_fmt(s.get('ttft_s_p90'), '{:.3f}'):>12}"
                         f"{_fmt(s['hit_rate'], '{:.1%}'):>10}{_fmt(s['fetched_gb_per_token'], '{:.3f}'):>18}")
    return "\n".join(lines)


CHART_PANELS = (("prefill_tokens_per_s", "prefill tokens/s", "{:.2f}"),
                ("decode_tokens_per_s", "decode tokens/s", "{:.2f}"),
                ("hit_rate", "unique-key hit rate", "{:.0%}"))
CHART_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def figure(runs: list[Run], title: str):
    """Per panel: the sets along x, one bar per run; a value a server did not report reads n/a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SETS if any(n in r.summary for r in runs)]
    width = 0.8 / len(runs)
    fig, axes = plt.subplots(1, len(CHART_PANELS), figsize=(4 + 4 * len(CHART_PANELS), 4.5))
    for ax, (key, label, pattern) in zip(axes, CHART_PANELS):
        for i, run in enumerate(runs):
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(names))]
            values = [(run.summary.get(n) or {}).get(key) for n in names]
            ax.bar(xs, [v or 0.0 for v in values], width, label=run.label, color=CHART_COLORS[i % len(CHART_COLORS)])
            for x, v in zip(xs, values):
                ax.text(x, v or 0.0, _fmt(v, pattern), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(label)
        ax.margins(y=0.1)  # room for the values above the bars
    if len(runs) > 1:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(runs), fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07 if len(runs) > 1 else 0, 1, 1))
    return fig


def chart(runs: list[Run], path: Path, title: str) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ServeError("the chart needs matplotlib: pip install 'expertpack[bench]'") from None
    fig = figure(runs, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(paths: list[Path], out: Path) -> int:
    """Earlier runs side by side: the table, the JSON line, then the chart."""
    runs = [Run.load(p) for p in paths]
    seen: dict[str, int] = {}
    for i, run in enumerate(runs):  # two runs under one name would merge in the chart's legend
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            runs[i] = Run(f"{run.label} ({seen[run.label]})", run.summary, run.conditions)
    max_tokens = sorted({r.conditions["max_tokens"] for r in runs}, key=str)
    if len(max_tokens) > 1:
        print(f"expertpack bench serve: warning: the runs differ in --max-tokens {max_tokens}", file=sys.stderr)
    print(table(runs))
    print(json.dumps({"bench": "serve-compare", "date": date.today().isoformat(),
                      "runs": [{"file": str(p), "label": r.label, **r.conditions, "summary": r.summary}
                               for p, r in zip(paths, runs)]}))
    out.mkdir(parents=True, exist_ok=True)
    png = out / "bench-serve-compare.png"
    chart(runs, png, f"{' vs '.join(r.label for r in runs)} — {'/'.join(map(str, max_tokens))} tokens per request")
    print(f"wrote {png}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="expertpack bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--endpoint", help="the server's base URL, e.g. http://127.0.0.1:8000 (or …/v1)")
    what.add_argument("--compare", nargs="+", type=Path, metavar="JSON",
                      help="draw these bench-serve.json files side by side instead of running")
    p.add_argument("--model", help="model id to ask for (default: the first of /v1/models)")
    p.add_argument("--max-tokens", type=int, default=200, help="completion tokens per request (default 200)")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for bench-serve.json and .png (bench-serve-compare.png with --compare)")
    p.add_argument("--label", default="", help="a name for this system in the outputs (e.g. 'expertpack 4 GiB')")
    p.add_argument("--api-key", help="sent as a bearer token (llama-server --api-key)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per request (default 3600)")
    p.add_argument("--concurrency", type=_at_least_one, default=1, metavar="N",
                   help="requests of a set in flight at once: N clients, each sending its next request when "
                        "its last is answered (default 1: one at a time)")
    p.add_argument("--repeat", type=_at_least_one, default=1, metavar="R",
                   help="send each set's five prompts R times, in order (default 1), so that --concurrency "
                        "above five keeps its requests in flight")
    args = p.parse_args(argv)
    if args.compare:
        try:
            return compare(args.compare, args.out)
        except ServeError as exc:
            print(f"expertpack bench serve: {exc}", file=sys.stderr)
            return 2
    base = args.endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        model = args.model or _first_model(base, args.api_key)
        results = []
        for set_name, prompts in SETS.items():
            results += run_set(base, model, set_name, prompts * args.repeat, args.max_tokens, args.api_key,
                               args.timeout_s, args.concurrency)
    except ServeError as exc:
        print(f"expertpack bench serve: {exc}", file=sys.stderr)
        return 2
    report = make_report(args.endpoint, model, args.label, args.max_tokens, results, args.concurrency, args.repeat)
    run = Run.from_report(report)
    print(table([run]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-serve.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "requests"}))
    try:  # last: a machine without matplotlib still gets the table and the JSON
        chart([run], args.out / "bench-serve.png",
              f"{run.label} — {args.max_tokens} tokens per request, temperature 0"
              + (f", {args.concurrency} in flight" if args.concurrency > 1 else ""))
    except ServeError as exc:
        print(f"expertpack bench serve: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'bench-serve.json'} and {args.out / 'bench-serve.png'}", file=sys.stderr)
    return 0


def _at_least_one(text: str) -> int:
    """--concurrency's type: argparse then names the flag and the value in its usage error."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of requests, at least 1")
    return n


def _first_model(base: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = json.load(r)["data"]
    except (urllib.error.URLError, KeyError, ValueError) as exc:
        raise ServeError(f"{base}/models: {exc}; is the server running? (or pass --model)") from None
    if not data:
        raise ServeError(f"{base}/models lists no model; pass --model")
    return data[0]["id"]
