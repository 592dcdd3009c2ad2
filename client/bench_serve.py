"""`expertpack bench serve --endpoint URL`: the reference serving protocol, replayed against any
OpenAI-compatible server (expert-worker, llama.cpp's llama-server, ...), so one run compares systems.

Ten fixed chat requests, one at a time: five instruction prompts in the Alpaca style and five
MMLU-style multiple-choice questions; temperature 0 and exactly --max-tokens completion tokens
(`ignore_eos`, which llama-server and vLLM also honour). Each request is streamed: prefill and
decode rates come from the server's `timings` when it reports them (llama-server, expert-worker),
else from the client's clock (time to first token; the rest). The unique-key hit rate and the SSD
bytes come from expert-worker's `expertpack` object (n/a elsewhere). Prints a table per set and
writes bench-serve.json and bench-serve.png (matplotlib) into --out."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from statistics import mean

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
    ssd_bytes: int | None
    seconds: float


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
            timeout: float) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks, seconds, first = _post_stream(f"{base}/chat/completions", body, api_key, timeout)
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    if usage is None:
        raise ServeError("the server sent no usage (stream_options.include_usage); cannot count tokens")
    timings = next((c["timings"] for c in reversed(chunks) if c.get("timings")), None)
    extra = next((c["expertpack"] for c in reversed(chunks) if c.get("expertpack")), None)
    n_prompt, n_done = usage["prompt_tokens"], usage["completion_tokens"]
    if timings:
        prefill, decode, source = timings["prompt_per_second"], timings["predicted_per_second"], "server"
    else:
        first = first or seconds
        prefill = n_prompt / first
        decode = (n_done - 1) / (seconds - first) if n_done > 1 and seconds > first else 0.0
        source = "client"
    return Result(set_name, index, n_prompt, n_done, prefill, decode, source,
                  extra and extra.get("hit_rate"), extra and extra.get("ssd_bytes"), seconds)


def summarize(results: list[Result]) -> dict[str, dict]:
    out = {}
    for name in SETS:
        rs = [r for r in results if r.set == name]
        if not rs:
            continue
        hits = [r.hit_rate for r in rs if r.hit_rate is not None]
        ssd = [r.ssd_bytes / r.completion_tokens for r in rs if r.ssd_bytes is not None and r.completion_tokens]
        out[name] = {"requests": len(rs), "prefill_tokens_per_s": mean(r.prefill_tokens_per_s for r in rs),
                     "decode_tokens_per_s": mean(r.decode_tokens_per_s for r in rs),
                     "hit_rate": mean(hits) if hits else None,
                     "ssd_gb_per_token": mean(ssd) / 1e9 if ssd else None,
                     "completion_tokens": sum(r.completion_tokens for r in rs)}
    return out


def chart(summary: dict[str, dict], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ServeError("the chart needs matplotlib: pip install 'expertpack[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in zip(axes, ("prefill_tokens_per_s", "decode_tokens_per_s", "hit_rate"),
                              ("prefill tokens/s", "decode tokens/s", "unique-key hit rate")):
        values = [summary[n][key] or 0.0 for n in names]
        ax.bar(names, values, color=["#4c72b0", "#dd8452"][:len(names)])
        ax.set_title(label)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}" if key != "hit_rate" else f"{v:.0%}", ha="center", va="bottom")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="expertpack bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (or …/v1)")
    p.add_argument("--model", help="model id to ask for (default: the first of /v1/models)")
    p.add_argument("--max-tokens", type=int, default=200, help="completion tokens per request (default 200)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench-serve.json and .png")
    p.add_argument("--label", default="", help="a name for this system in the outputs (e.g. 'expertpack 4 GiB')")
    p.add_argument("--api-key", help="sent as a bearer token (llama-server --api-key)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per request (default 3600)")
    args = p.parse_args(argv)
    base = args.endpoint.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        model = args.model or _first_model(base, args.api_key)
        results = []
        for set_name, prompts in SETS.items():
            for i, prompt in enumerate(prompts):
                r = run_one(base, model, set_name, i, prompt, args.max_tokens, args.api_key, args.timeout_s)
                print(f"{set_name} {i + 1}/{len(prompts)}: {r.prompt_tokens} + {r.completion_tokens} tokens, prefill "
                      f"{r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.2f} tok/s "
                      f"({r.rates_from})", file=sys.stderr)
                if r.completion_tokens != args.max_tokens:
                    print(f"  warning: {r.completion_tokens} completion tokens, not {args.max_tokens} (the server "
                          "may not honour ignore_eos)", file=sys.stderr)
                results.append(r)
    except ServeError as exc:
        print(f"expertpack bench serve: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results)

    def fmt(v: float | None, pattern: str) -> str:
        return "n/a" if v is None else pattern.format(v)

    print(f"{'set':<17}{'requests':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'hit rate':>10}{'SSD GB/token':>14}")
    for name, s in summary.items():
        print(f"{name:<17}{s['requests']:>9}{s['prefill_tokens_per_s']:>15.2f}{s['decode_tokens_per_s']:>14.2f}"
              f"{fmt(s['hit_rate'], '{:.1%}'):>10}{fmt(s['ssd_gb_per_token'], '{:.3f}'):>14}")
    report = {"bench": "serve", "date": date.today().isoformat(), "endpoint": args.endpoint, "model": model,
              "label": args.label, "max_tokens": args.max_tokens, "summary": summary,
              "requests": [asdict(r) for r in results]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-serve.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "requests"}))
    try:  # last: a machine without matplotlib still gets the table and the JSON
        chart(summary, args.out / "bench-serve.png",
              f"{args.label or model} — {args.max_tokens} tokens per request, temperature 0")
    except ServeError as exc:
        print(f"expertpack bench serve: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'bench-serve.json'} and {args.out / 'bench-serve.png'}", file=sys.stderr)
    return 0


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
