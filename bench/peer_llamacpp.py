#!/usr/bin/env python3
"""llama.cpp and expertpack side by side on the same GGUF, in one run: llama.cpp built from the
source vendored in the llama-cpp-python sdist on PyPI, `llama-bench -ngl 99` for its decode (tg) and
prefill (pp) rates, and expertpack's worker with every expert resident on the same device timed the
same way (a fresh KV cache per test, N decode steps one token at a time, P-token prompts). Prints a
table with the ratio expertpack / llama.cpp, draws a bar chart (matplotlib, when installed) and, as
its last line, one JSON object with the conditions.

  python3 bench/peer_llamacpp.py fetch --dest .peer/llama.cpp            # needs PyPI; prints the size
  python3 bench/peer_llamacpp.py build --src .peer/llama.cpp --prefix /tmp/llama-build [-j 16] [--no-cuda]
  python3 bench/peer_llamacpp.py run --bin /tmp/llama-build/bin --preset qwen3-30b-a3b --layers 12 --out bench-out
  python3 bench/peer_llamacpp.py run --bin /tmp/llama-build/bin --gguf model.gguf --device cpu --pp 8 --tg 4

bench/peer_on_device.sh runs build and run on the GPU machine. `fetch` keeps only what building
llama-bench and llama-server needs (no models, docs, tests, web-UI sources or other GPU backends)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from statistics import mean, stdev

REPO = Path(__file__).resolve().parents[1]
SDIST = "llama-cpp-python==0.3.36"
VENDORED = "vendor/llama.cpp"
SOURCE_INFO = "PEER_SOURCE.json"  # written by fetch into the source folder: the sdist and the commit

# Under the vendored llama.cpp: what building llama-bench and llama-server (CPU or CUDA) never reads.
DROP = (
    "models", "docs", "media", "benches", "tests", "examples", "pocs", "gguf-py", "conversion", "grammars",
    "prompts", "requirements", "ci", "skills", ".github", ".devops", "AUTHORS", "convert_hf_to_gguf_update.py",
    # the server's web UI: only its CMake and templates are read (the assets come prebuilt or not at all)
    "tools/ui/src", "tools/ui/tests", "tools/ui/static", "tools/ui/package-lock.json",
    # ggml backends other than CPU, CUDA, BLAS and RPC
    *(f"ggml/src/ggml-{b}" for b in ("cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino",
                                     "sycl", "virtgpu", "vulkan", "webgpu", "zdnn", "zendnn")),
)

TARGETS = ("llama-bench", "llama-server")
# LLAMA_CURL is gone from this version (a deprecation warning only): LLAMA_OPENSSL replaced it.
# LLAMA_BUILD_TOOLS and LLAMA_BUILD_SERVER gate the two targets; the prebuilt web UI is a download,
# which the GPU machine cannot make, so the server builds without one.
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "LLAMA_BUILD_APP": "OFF", "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON", "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF",
}
CUDA_OPTIONS = {"GGML_CUDA": "ON", "CMAKE_CUDA_ARCHITECTURES": "90"}


class PeerError(RuntimeError):
    pass


# ---- fetch -----------------------------------------------------------------------------------------

def _dropped(rel: str) -> bool:
    return any(rel == d or rel.startswith(d + "/") for d in DROP)


def fetch(dest: Path) -> int:
    """Downloads the sdist, extracts its vendored llama.cpp into dest; returns the bytes kept."""
    if dest.exists():
        if not (dest / SOURCE_INFO).exists():
            raise PeerError(f"{dest} exists and is not a folder fetch wrote; remove it or pick another")
        shutil.rmtree(dest)
    with tempfile.TemporaryDirectory(prefix="peer-fetch-") as tmp:
        print(f"pip download {SDIST} (source) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", tmp], check=True, stdout=sys.stderr)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            root = tar.getmembers()[0].name.split("/")[0]
            try:  # the submodule's checkout, as the sdist keeps it
                commit = tar.extractfile(f"{root}/.git/modules/{VENDORED}/HEAD").read().decode().strip()
            except (KeyError, AttributeError):
                commit = "unknown"
            prefix = f"{root}/{VENDORED}/"
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if not rel or rel == ".git" or _dropped(rel) or not (m.isfile() or m.isdir()):
                    continue
                m.name = rel
                members.append(m)
            dest.mkdir(parents=True)
            tar.extractall(dest, members=members, filter="data")
    (dest / SOURCE_INFO).write_text(json.dumps({"sdist": SDIST, "commit": commit}) + "\n")
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


# ---- build -----------------------------------------------------------------------------------------

def build(src: Path, prefix: Path, cuda: bool, jobs: int) -> Path:
    """Configures out of tree in prefix and builds llama-bench and llama-server; returns the bin folder."""
    info = json.loads((src / SOURCE_INFO).read_text()) if (src / SOURCE_INFO).exists() else {"commit": "unknown"}
    options = {**CMAKE_OPTIONS, **(CUDA_OPTIONS if cuda else {"GGML_CUDA": "OFF"}),
               "LLAMA_BUILD_COMMIT": info["commit"][:7]}
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # llama.cpp asks git for its commit; the source may sit inside another repository (ours), whose
    # commit it would report: git looks no further up than the source's parent.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(src.resolve().parent)}
    configure = ["cmake", "-S", str(src), "-B", str(prefix), *generator, *(f"-D{k}={v}" for k, v in options.items())]
    steps = {"configure": configure, "build": ["cmake", "--build", str(prefix), "--target", *TARGETS, "-j", str(jobs)]}
    for step, cmd in steps.items():
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd, stdout=sys.stderr, env=env).returncode:
            raise PeerError(f"cmake's {step} step failed (output above)")
    return prefix / "bin"


# ---- run: llama.cpp --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rates:
    """Tokens per second by test name (`tg128`, `pp32`, ...), as llama-bench names its tests."""
    tokens_per_s: dict[str, float]
    stddev: dict[str, float]


def rate_key(n_prompt: int, n_gen: int) -> str:
    return f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"


def parse_llama_bench(records: list[dict]) -> tuple[Rates, dict]:
    """llama-bench's `-o json` (a list, one object per test) -> its rates and its build's conditions."""
    rates = {rate_key(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in records}
    stddev = {rate_key(r["n_prompt"], r["n_gen"]): r["stddev_ts"] for r in records}
    first = records[0]
    conditions = {k: first.get(k) for k in ("build_commit", "build_number", "backends", "gpu_info", "cpu_info",
                                             "model_type", "model_size", "n_gpu_layers", "n_threads", "n_batch")}
    return Rates(rates, stddev), conditions


def run_llama_bench(bin_dir: Path, gguf: Path, pp: list[int], tg: int, reps: int, log: Path) -> list[dict]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-p", ",".join(map(str, pp)),
           "-n", str(tg), "-r", str(reps), "-o", "json"]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise PeerError(f"llama-bench exited with {proc.returncode}; the end of {log}:\n{tail}")
    return json.loads(proc.stdout)


# ---- run: expertpack -------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineRates:
    rates: Rates
    argmax_sha256: str  # of the argmax after every decode step: a wrong model shows here
    load_s: float


def time_engine(engine, prompt_lengths: list[int], n_decode: int, reps: int, device: str) -> tuple[Rates, str]:
    """llama-bench's tests, on expertpack: each test from a fresh KV cache, after one warm-up run of
    the same shape; tokens from a fixed pseudo-random stream (bench/decode_streaming.py says why);
    tokens/s averaged over reps as llama-bench's avg_ts is."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    vocab = engine.forward([1], engine.new_sequence()).shape[-1]
    stream = random.Random(0).choices(range(vocab), k=max([*prompt_lengths, n_decode]))

    def prefill(n: int) -> float:
        cache = engine.new_sequence()
        sync()
        t0 = time.perf_counter()
        engine.forward(stream[:n], cache, last=True)  # as llama-bench: its batch outputs the last token only
        sync()
        return n / (time.perf_counter() - t0)

    def decode(n: int, argmax: list) -> float:
        cache = engine.new_sequence()
        sync()
        t0 = time.perf_counter()
        for token in stream[:n]:
            argmax.append(engine.forward([token], cache)[-1].argmax())  # stays on the device: no sync per step
        sync()
        return n / (time.perf_counter() - t0)

    def report(key: str, xs: list[float]) -> list[float]:
        print(f"expertpack {key}: " + ", ".join(f"{x:.2f}" for x in xs) + " tok/s", file=sys.stderr, flush=True)
        return xs

    samples = {}
    for p in prompt_lengths:
        prefill(p)  # warm-up of this shape
        samples[rate_key(p, 0)] = report(rate_key(p, 0), [prefill(p) for _ in range(reps)])
    decode(2, [])
    argmax: list = []
    samples[rate_key(0, n_decode)] = report(rate_key(0, n_decode),
                                           [decode(n_decode, [] if i else argmax) for i in range(reps)])
    digest = hashlib.sha256(json.dumps([int(t) for t in argmax]).encode()).hexdigest()[:16]
    return Rates({k: mean(v) for k, v in samples.items()},
                 {k: stdev(v) if len(v) > 1 else 0.0 for k, v in samples.items()}), digest


def measure_expertpack(gguf: Path, device: str, prompt_lengths: list[int], n_decode: int, reps: int) -> EngineRates:
    """Every expert resident on the device, the model read from the GGUF itself."""
    import torch

    from expertpack.worker.engine.engine import Engine

    t0 = time.perf_counter()
    engine = Engine.load(gguf, device=device, resident_experts=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    try:
        rates, digest = time_engine(engine, prompt_lengths, n_decode, reps, device)
    finally:
        engine.close()
    return EngineRates(rates, digest, load_s)


# ---- run: report -----------------------------------------------------------------------------------

def gguf_conditions(gguf: Path) -> dict:
    """Architecture and the ggml types of the routed experts and of everything else."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else "unknown"
    experts, trunk = set(), set()
    for t in reader.tensors:
        (experts if "_exps" in t.name else trunk).add(t.tensor_type.name)
    return {"file": gguf.name, "size_bytes": gguf.stat().st_size, "arch": arch,
            "quant_types": {"experts": sorted(experts), "trunk": sorted(trunk)}}


def table(tests: list[str], llama: Rates, ours: Rates) -> str:
    ratio = {t: ours.tokens_per_s[t] / llama.tokens_per_s[t] for t in tests}
    lines = [f"{'':24}" + "".join(f"{t + ' tok/s':>14}" for t in tests)]
    for name, values, pattern in (("llama.cpp (llama-bench)", llama.tokens_per_s, "{:14.2f}"),
                                  ("expertpack (resident)", ours.tokens_per_s, "{:14.2f}"),
                                  ("expertpack / llama.cpp", ratio, "{:14.3f}")):
        lines.append(f"{name:<24}" + "".join(pattern.format(values[t]) for t in tests))
    return "\n".join(lines)


def chart(tests: list[str], llama: Rates, ours: Rates, path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is not installed (pip install 'expertpack[bench]')", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for i, (label, rates, color) in enumerate((("llama.cpp", llama, "#dd8452"), ("expertpack", ours, "#4c72b0"))):
        xs = [j + (i - 0.5) * width for j in range(len(tests))]
        values = [rates.tokens_per_s[t] for t in tests]
        ax.bar(xs, values, width, label=label, color=color)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(tests)), [f"{t}\n{ours.tokens_per_s[t] / llama.tokens_per_s[t]:.3g}x" for t in tests])
    ax.set_yscale("log")  # the two can be orders of magnitude apart
    ax.set_ylabel("tokens/s (log scale)")
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def synthesized(preset: str, layers: int | None, out: Path) -> Path:
    """The preset's GGUF in out (named as bench/decode_streaming.py names it), written if missing."""
    from expertpack.packtools.synth.writer import SynthOptions, write_synth

    path = out / f"{preset}{f'-{layers}L' if layers else ''}.gguf"
    if not path.exists():
        print(f"synthesizing {path} ...", file=sys.stderr, flush=True)
        partial = path.with_suffix(".partial")
        write_synth(partial, SynthOptions(preset=preset, n_layer=layers, progress=False))
        partial.rename(path)
    return path


def run(args: argparse.Namespace) -> int:
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or synthesized(args.preset, args.layers, args.out)
    tests = [rate_key(0, args.tg)] + [rate_key(p, 0) for p in args.pp]
    records = run_llama_bench(args.bin, gguf, args.pp, args.tg, args.reps, args.out / "llama-bench.log")
    (args.out / "llama-bench.json").write_text(json.dumps(records, indent=1))
    llama, build_info = parse_llama_bench(records)
    ours = measure_expertpack(gguf, args.device, args.pp, args.tg, args.reps)
    model = gguf_conditions(gguf)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    print(f"model  {model['file']} ({model['size_bytes'] / 2**30:.2f} GiB, {model['arch']}, experts "
          f"{'/'.join(model['quant_types']['experts'])}, trunk {'/'.join(model['quant_types']['trunk'])})")
    print(f"device {args.device} ({gpu}); llama.cpp {build_info['build_commit']} ({build_info['backends']}, "
          f"-ngl 99); {args.reps} reps; expertpack load {ours.load_s:.1f} s, argmax sha256 {ours.argmax_sha256}")
    print(table(tests, llama, ours.rates))
    png = args.out / "peer-llamacpp.png"
    drawn = chart(tests, llama, ours.rates, png, f"{model['file']} on {gpu if gpu != 'none' else 'CPU'}: "
                  "llama.cpp (llama-bench -ngl 99) vs expertpack (resident)")
    if drawn:
        print(f"wrote {png}", file=sys.stderr)
    commit = args.commit or subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    print(json.dumps({
        "bench": "peer_llamacpp", "date": date.today().isoformat(), "commit": commit,
        "machine": f"{platform.node()} {os.cpu_count()} cpu", "gpu": gpu, "device": args.device,
        "torch": torch.__version__, "model": model, "reps": args.reps,
        "llama_cpp": {"sdist": SDIST, **build_info, "tokens_per_s": llama.tokens_per_s, "stddev": llama.stddev},
        "expertpack": {"experts": "resident", "tokens_per_s": ours.rates.tokens_per_s, "stddev": ours.rates.stddev,
                       "load_s": round(ours.load_s, 3), "argmax_sha256": ours.argmax_sha256},
        "ratio": {t: round(ours.rates.tokens_per_s[t] / llama.tokens_per_s[t], 4) for t in tests},
    }))
    return 0


# ---- command line ----------------------------------------------------------------------------------

def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peer_llamacpp.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help=f"download the {SDIST} sdist and keep its llama.cpp source, trimmed",
                       description=f"pip download --no-deps --no-binary :all: {SDIST}, then extract its "
                       f"{VENDORED} into DEST without what the build never reads ({', '.join(DROP[:6])}, ...); "
                       f"writes {SOURCE_INFO} (the sdist and llama.cpp's commit) and prints the size.")
    f.add_argument("--dest", type=Path, required=True, help="folder to write (e.g. .peer/llama.cpp, git-ignored)")
    b = sub.add_parser("build", help="build llama-bench and llama-server out of tree",
                       description="cmake -S SRC -B PREFIX " + " ".join(
                           f"-D{k}={v}" for k, v in {**CMAKE_OPTIONS, **CUDA_OPTIONS}.items())
                       + ", then the targets " + " ".join(TARGETS) + "; cmake's and the compiler's output go to "
                       "stderr. Ninja when installed.")
    b.add_argument("--src", type=Path, required=True, help="the folder fetch wrote")
    b.add_argument("--prefix", type=Path, required=True, help="the build folder; binaries land in PREFIX/bin")
    b.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=True,
                   help="GGML_CUDA for sm_90, the H200 (default); --no-cuda for a CPU build")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs (default: all cores)")
    r = sub.add_parser("run", help="llama-bench, then expertpack, on the same GGUF; table, chart, JSON",
                       description="llama-bench -m GGUF -ngl 99 -p PP -n TG -r REPS -o json, then expertpack "
                       "(Engine.load(GGUF, resident_experts=True)) through the same tests: the prompt lengths "
                       "PP, TG tokens decoded one at a time, each from a fresh KV cache after a warm-up. "
                       "Prints the table, writes OUT/peer-llamacpp.png, OUT/llama-bench.json and its log; the "
                       "last line is one JSON object.")
    r.add_argument("--bin", type=Path, required=True, help="folder holding llama-bench (PREFIX/bin of build)")
    model = r.add_mutually_exclusive_group(required=True)
    model.add_argument("--gguf", type=Path, help="the model file")
    model.add_argument("--preset", help="synthesize this preset (expertpack synth --list) into --out if missing")
    r.add_argument("--layers", type=int, help="with --preset: keep the first N layers")
    r.add_argument("--device", default="cuda", help="expertpack's device (default cuda)")
    r.add_argument("--pp", type=_lengths, default=[32, 512], help="prompt lengths, comma-separated (default 32,512)")
    r.add_argument("--tg", type=int, default=128, help="tokens decoded one at a time (default 128)")
    r.add_argument("--reps", type=int, default=3, help="repetitions of each test, both systems (default 3)")
    r.add_argument("--commit", help="expertpack's commit to record (default: git's, where the copy has .git)")
    r.add_argument("--out", type=Path, default=REPO / "bench-out",
                   help="folder for the chart, llama-bench's JSON and log, and a synthesized GGUF (default bench-out)")
    args = p.parse_args(argv)
    try:
        if args.command == "fetch":
            size = fetch(args.dest)
            print(f"{args.dest}: {size / 2**20:.1f} MiB of llama.cpp source "
                  f"({json.loads((args.dest / SOURCE_INFO).read_text())['commit'][:12]})")
        elif args.command == "build":
            bin_dir = build(args.src, args.prefix, args.cuda, args.jobs)
            print(f"built {', '.join(str(bin_dir / t) for t in TARGETS)}")
        else:
            if args.layers and not args.preset:
                p.error("--layers goes with --preset")
            return run(args)
    except (PeerError, subprocess.CalledProcessError) as exc:
        print(f"peer_llamacpp.py {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
