#!/usr/bin/env bash
# The serving benchmark on the lent GPU machine (see ../.library/device), in one call: synthesize
# and pack a Qwen3-30B-A3B-shaped model (LAYERS of its 48 layers), measure it with
# bench/decode_streaming.py (streaming vs resident vs the I/O bound, cache CACHE_GIB), then start
# expertd and expert-worker (CUDA, the same cache) and replay `expertpack bench serve` with
# MAX_TOKENS per request. Needs .whl carried along (../shared/device/wheels.sh plus jinja2 and
# markupsafe; that machine has matplotlib). Usage there:
#   bash bench/serve_on_device.sh LAYERS CACHE_GIB MAX_TOKENS
# or, against llama-server on the same GGUF (carry .peer too: python3 bench/peer_llamacpp.py fetch
# --dest .peer/llama.cpp), in one call of about 7 minutes (the llama.cpp build runs meanwhile):
#   bash bench/serve_on_device.sh peer LAYERS CACHE_GIB MAX_TOKENS [CONCURRENCY [REPEAT]]
# which starts the build, serves the pack through expertd and expert-worker (measured once the build is
# done, which would take its CPU), then the GGUF through `llama-server -ngl 99 -np N`, runs
# `expertpack bench serve` on each and compares them (each set's prompts sent REPEAT times, by
# default enough for twice CONCURRENCY requests a set). CONCURRENCY may be a list (4,16): one
# expert-worker with --max-batch N and one llama-server with -np N, N the largest, and one
# `bench serve` and comparison each, so that both run as many together. PEER=0 measures
# expert-worker alone (no build, no llama-server: a couple of minutes); there EXPERTD_FLAGS goes
# to expertd (--ram-cache-gib 0: every miss read from the SSD), and each run prints the pack bytes
# expertd read per completion token (`expertctl stats`), what streaming costs the disk.
set -euo pipefail
if [ "${1:-}" = peer ]; then
    layers=${2:-12} cache_gib=${3:-8} max_tokens=${4:-64} concurrency=${5:-1}
    peer=${PEER:-1}
    max_batch=$(tr , '\n' <<< "$concurrency" | sort -n | tail -1)
    [ "$peer" = 1 ] && bash bench/peer_on_device.sh start-build
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
    export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
    out=${OUT:-/tmp}
    stem="qwen3-30b-a3b-${layers}L"
    python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from decode_streaming import prepare_pack; prepare_pack('qwen3-30b-a3b', $layers, Path('bench-out'))"
    run=$(mktemp -d)
    # shellcheck disable=SC2086  # EXPERTD_FLAGS: flags, split on purpose
    expertd --pack "bench-out/$stem.pack" --endpoint "ipc://$run/expertd.sock" ${EXPERTD_FLAGS:-} 2> "$out/expertd.log" &
    daemon=$!
    worker= server=
    trap 'kill $daemon $worker $server 2>/dev/null || true' EXIT
    for _ in $(seq 100); do [ -S "$run/expertd.sock" ] && break; sleep 0.1; done
    expert-worker --pack "bench-out/$stem.pack" --daemon "ipc://$run/expertd.sock" --device cuda --port 8123 \
        --model-name "$stem" --cache-vram-mib $((cache_gib * 1024)) --max-batch "$max_batch" 2> "$out/worker.log" &
    worker=$!
    up() { for _ in $(seq 1200); do
        python3 -c "import urllib.request; urllib.request.urlopen('$1/health', timeout=5)" 2>/dev/null && return 0
        sleep 0.5; done; return 1; }
    up http://127.0.0.1:8123
    grep -E "warmed up|serving" "$out/worker.log" | cut -c1-300
    # measured once the build is done: its 16 jobs would take the worker's host thread's CPU
    while [ "$peer" = 1 ] && [ ! -f /tmp/llama-build.rc ]; do sleep 5; done
    read_bytes() { expertctl stats --endpoint "ipc://$run/expertd.sock" --json \
        | python3 -c "import json, sys; print(json.load(sys.stdin)['counters']['pack_read_bytes'])"; }
    for n in ${concurrency//,/ }; do
        [ "$n" = "$concurrency" ] && dest="$out/expertpack" || dest="$out/expertpack-$n"
        before=$(read_bytes)
        expertpack bench serve --endpoint http://127.0.0.1:8123 --max-tokens "$max_tokens" --concurrency "$n" \
            --repeat "${6:-$(( (2 * n + 4) / 5 ))}" --out "$dest" --label "expert-worker ${cache_gib} GiB cache" 2>&1 | tail -4
        after=$(read_bytes)
        python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; \
t = sum(v['completion_tokens'] for v in s.values()); w = sum(v['wall_s'] for v in s.values()); gb = ($after - $before) / 1e9; \
print(f'concurrency $n: {t} tokens in {w:.2f} s ({t / w:.1f} tok/s), {gb:.3f} GB read from the pack: {gb / t * 1e3:.2f} MB a token')" \
            "$dest/bench-serve.json"
    done
    # where the generation thread's time went: decode steps by rows, the tokens taken from them, prompt pieces
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/metrics').read().decode())" \
        | grep -E '^expertpack_(decode_steps|prompt_p|generation_thread)' || true
    kill -TERM "$worker" && wait "$worker" || true
    kill -TERM "$daemon" && wait "$daemon" || true
    worker= daemon=
    [ "$peer" = 1 ] || { trap - EXIT; exit 0; }
    while [ ! -f /tmp/llama-build.rc ]; do sleep 5; done
    [ "$(cat /tmp/llama-build.rc)" = 0 ] || { tail -20 /tmp/llama-build.log; exit 1; }
    /tmp/llama-build/bin/llama-server -m "bench-out/$stem.gguf" -ngl 99 -np "$max_batch" --port 8080 \
        > "$out/llama-server.log" 2>&1 &
    server=$!
    up http://127.0.0.1:8080
    for n in ${concurrency//,/ }; do
        [ "$n" = "$concurrency" ] && suffix= || suffix="-$n"
        expertpack bench serve --endpoint http://127.0.0.1:8080 --max-tokens "$max_tokens" --concurrency "$n" \
            --repeat "${6:-$(( (2 * n + 4) / 5 ))}" --out "$out/llama$suffix" --label "llama-server -ngl 99" 2>&1 | tail -4
    done
    kill -TERM "$server" && wait "$server" || true
    server=
    trap - EXIT
    for n in ${concurrency//,/ }; do
        [ "$n" = "$concurrency" ] && suffix= || suffix="-$n"
        expertpack bench serve --compare "$out/expertpack$suffix/bench-serve.json" "$out/llama$suffix/bench-serve.json" \
            --out "$out${suffix:+/compare$suffix}" 2>&1 | tail -12
    done
    exit 0
fi
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
