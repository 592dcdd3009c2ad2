#!/usr/bin/env bash
# The serving benchmark on the lent GPU machine (see ../.library/device), in one call: synthesize
# and pack a Qwen3-30B-A3B-shaped model (LAYERS of its 48 layers), measure it with
# bench/decode_streaming.py (streaming vs resident vs the I/O bound, cache CACHE_GIB), then start
# expertd and expert-worker (CUDA, the same cache) and replay `expertpack bench serve` with
# MAX_TOKENS per request. Needs .whl carried along (../shared/device/wheels.sh plus jinja2 and
# markupsafe; that machine has matplotlib). Usage there:
#   bash bench/serve_on_device.sh LAYERS CACHE_GIB MAX_TOKENS
set -euo pipefail
layers=${1:-48}
cache_gib=${2:-4}
max_tokens=${3:-200}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PWD/.devtools:$PATH" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
stem="qwen3-30b-a3b-${layers}L"
python3 bench/decode_streaming.py --layers "$layers" --cache-gib "$cache_gib" --dir bench-out 2>&1 | tee "$out/decode.log"

run=$(mktemp -d)
expertd --pack "bench-out/$stem.pack" --endpoint "ipc://$run/expertd.sock" 2> "$out/expertd.log" &
daemon=$!
trap 'kill $daemon $worker 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$run/expertd.sock" ] && break; sleep 0.1; done
expert-worker --pack "bench-out/$stem.pack" --daemon "ipc://$run/expertd.sock" --device cuda --port 8123 \
    --model-name "$stem" --cache-vram-mib $((cache_gib * 1024)) 2> "$out/worker.log" &
worker=$!
for _ in $(seq 600); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=5)" 2>/dev/null && break
    sleep 0.5
done
head -1 "$out/worker.log"
expertpack bench serve --endpoint http://127.0.0.1:8123 --max-tokens "$max_tokens" --out "$out" \
    --label "expertpack, $stem, ${cache_gib} GiB cache, H200" 2>&1 | tail -6
kill -TERM "$worker" && wait "$worker"
kill -TERM "$daemon" && wait "$daemon"
trap - EXIT
