#!/usr/bin/env bash
# `make demo`: the main job end to end on a tiny built-in model, on the CPU: synthesize a
# Qwen3-MoE-shaped GGUF (random weights: its answers are noise, the path is the point), pack and
# verify it, start expertd on the pack and expert-worker against expertd with a cache smaller than
# the experts, ask one chat question through the OpenAI-compatible HTTP API, print the answer and
# the request's stats, show `expertctl stats`, and stop both with SIGTERM.
set -euo pipefail
bin=.venv/bin
out=demo-out
port=${DEMO_PORT:-8731}
rm -rf "$out" && mkdir -p "$out"
"$bin/expertpack" synth --preset tiny -o "$out/tiny.gguf"
"$bin/expertpack" build "$out/tiny.gguf" -o "$out/tiny.expertpack"
"$bin/expertpack" verify "$out/tiny.expertpack"
"$bin/expertpack" inspect "$out/tiny.expertpack"

endpoint="ipc://$PWD/$out/expertd.sock"
"$bin/expertd" --pack "$out/tiny.expertpack" --endpoint "$endpoint" --stage-slots 16 --client-slots 8 &
daemon=$!
worker=
cleanup() { kill $worker $daemon 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$out/expertd.sock" ] && break; sleep 0.1; done

# 2 MiB of cache for 7 MiB of experts: the cache evicts, expertd streams the misses.
"$bin/expert-worker" --pack "$out/tiny.expertpack" --daemon "$endpoint" --device cpu --port "$port" \
    --model-name tiny --cache-vram-mib 2 &
worker=$!
for _ in $(seq 300); do
    "$bin/python" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=5)" \
        "http://127.0.0.1:$port/health" 2>/dev/null && break
    kill -0 "$worker" || { echo "expert-worker exited" >&2; exit 1; }
    sleep 0.2
done

"$bin/python" - "$port" <<'PY'
import json, sys, urllib.request
port = sys.argv[1]
body = {"model": "tiny", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is an expert in a Mixture-of-Experts model?"}]}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=300))
t, x, u = r["timings"], r["expertpack"], r["usage"]
print("\nPOST /v1/chat/completions  (random weights: the words are noise; the path is real)")
print(f"  answer: {r['choices'][0]['message']['content']!r}")
print(f"  tokens: {u['prompt_tokens']} prompt, {u['completion_tokens']} completion "
      f"({r['choices'][0]['finish_reason']})")
print(f"  prefill {t['prompt_per_second']:.1f} tok/s, decode {t['predicted_per_second']:.1f} tok/s, "
      f"unique-key hit rate {'-' if x['hit_rate'] is None else format(x['hit_rate'], '.1%')}, "
      f"{x['fetched_bytes'] / 1e6:.1f} MB of experts fetched from expertd, "
      f"{x['cache']['evictions']} evictions")
PY
"$bin/expertctl" stats --endpoint "$endpoint"

kill -TERM "$worker" && wait "$worker"
kill -TERM "$daemon" && wait "$daemon"
trap - EXIT
echo "demo done: expertd and expert-worker stopped cleanly"
