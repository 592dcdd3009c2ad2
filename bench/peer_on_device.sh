#!/usr/bin/env bash
# llama.cpp beside expertpack on the lent GPU machine (see ../.library/device): bench/peer_llamacpp.py
# builds llama-bench and llama-server with CUDA, then measures both on one synthesized GGUF. One call
# may last 10 minutes and the build takes about 5.5 with -j16, so it runs in two calls, the second
# within the machine's warm window (30 s) after the first:
#   bash bench/peer_on_device.sh start-build
#       copies .peer/llama.cpp to /tmp/llama-src and starts the build into /tmp/llama-build in the
#       background (setsid nohup, log /tmp/llama-build.log); returns at once.
#   bash bench/peer_on_device.sh run PRESET LAYERS [TG] [REPS]
#       installs the wheels and the project, synthesizes bench-out/PRESET-LAYERSL.gguf unless there,
#       starts the build if none ran on this machine, waits for it (the end of its log if it
#       failed; a call cut off by its limit leaves it running: call run again), then runs
#       peer_llamacpp.py run: a table, the chart, as last line one JSON object; llama-bench's JSON
#       and log, the chart and the build log into $OUT. TG tokens decoded (default 128), REPS
#       repetitions of each test (default 3).
#   bash bench/peer_on_device.sh offload PRESET LAYERS --vram-gib V --ram-gib R [peer_offload.py flags]
#       the same, then llama.cpp's -ncmoe splits that fit V GiB of VRAM against expertpack streaming,
#       both under an R GiB memory cgroup, the page cache dropped before each (bench/peer_offload.py).
# Carry .whl (../shared/device/wheels.sh) and .peer (here: python3 bench/peer_llamacpp.py fetch
# --dest .peer/llama.cpp; that machine reaches no registry). E.g. run qwen3-30b-a3b 12, gpt-oss-20b 24.
# COMMIT=<hash> names expertpack's commit in the JSON where the copy there has no .git. DEVICE=cpu
# (both calls) builds without CUDA and measures on the CPU: a smoke test off the GPU machine.
# TYPE=IQ2_XXS (any ggml type synth writes) gives the routed experts that type instead of the
# preset's, MIX=SPEC a per-role/per-layer mix as synth's --mix: run's GGUF is then
# bench-out/PRESET-LAYERSL-TYPE[-MIX].gguf (issue 36's i-quant targets).
set -euo pipefail
device=${DEVICE:-cuda}
src=/tmp/llama-src
build=/tmp/llama-build
log=/tmp/llama-build.log
rc_file=/tmp/llama-build.rc  # written when the build ends: its exit status
pid_file=/tmp/llama-build.pid

building() { [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; }
progress() { grep -o '^\[[0-9/]*\]' "$log" | tail -1; }  # ninja's [done/total]

start_build() {
    if [ ! -f .peer/llama.cpp/PEER_SOURCE.json ]; then
        echo "no .peer/llama.cpp: fetch it here (see above) and carry .peer" >&2
        exit 2
    fi
    rm -rf "$src" "$rc_file"
    cp -r .peer/llama.cpp "$src"  # outside the work tree, which the next call's copy replaces
    cp bench/peer_llamacpp.py /tmp/peer_llamacpp.py
    local cuda=--cuda
    [ "$device" = cpu ] && cuda=--no-cuda
    setsid nohup bash -c "python3 /tmp/peer_llamacpp.py build --src $src --prefix $build $cuda -j $(nproc) \
        > $log 2>&1; echo \$? > $rc_file" > /dev/null 2>&1 < /dev/null &
    echo $! > "$pid_file"
    echo "building into $build (pid $!, log $log, $(nproc) jobs)"
}

case "${1:-}" in
start-build)
    if [ "$(cat "$rc_file" 2>/dev/null)" = 0 ]; then echo "already built: $build/bin"; exit 0; fi
    if building; then echo "already building (pid $(cat "$pid_file")): $log"; exit 0; fi
    start_build
    ;;
run | offload)
    what=$1
    preset=${2:?$what PRESET LAYERS ...}
    layers=${3:?$what PRESET LAYERS ...}
    tg=${4:-128}
    reps=${5:-3}
    [ -f "$rc_file" ] || building || start_build  # the machine went back since start-build, or none ran
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
    export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
    out=${OUT:-/tmp}
    gguf="bench-out/$preset-${layers}L.gguf"  # the name bench/decode_streaming.py gives it
    types=()
    if [ -n "${TYPE:-}" ]; then
        types=(--type "$TYPE")
        gguf="bench-out/$preset-${layers}L-$TYPE${MIX:+-${MIX//[=,]/_}}.gguf"
        [ -n "${MIX:-}" ] && types+=(--mix "$MIX")
    fi
    if [ ! -f "$gguf" ]; then  # while the build runs
        mkdir -p bench-out
        expertpack synth --preset "$preset" --layers "$layers" "${types[@]}" -o "bench-out/partial-$preset.gguf" -q \
            --force > /dev/null
        mv "bench-out/partial-$preset.gguf" "$gguf"
    fi
    waited=0
    while [ ! -f "$rc_file" ]; do
        building || [ -f "$rc_file" ] || { echo "the build stopped without a status; see $log" >&2; exit 1; }
        [ $((waited % 30)) = 0 ] && echo "waiting for the build (${waited} s): $(progress)"
        sleep 5
        waited=$((waited + 5))
    done
    cp "$log" "$out/llama-build.log"
    if [ "$(cat "$rc_file")" != 0 ]; then
        echo "the llama.cpp build failed ($(cat "$rc_file")); the end of $log:" >&2
        tail -40 "$log" >&2
        exit 1
    fi
    if [ "$what" = offload ]; then  # the memory budgets: bench/peer_offload.py
        shift 3
        python3 bench/peer_offload.py --bin "$build/bin" --preset "$preset" --layers "$layers" --dir bench-out "$@" \
            2>&1 | tee "$out/offload.log"
        exit
    fi
    python3 bench/peer_llamacpp.py run --bin "$build/bin" --gguf "$gguf" --device "$device" --pp 32,512 \
        --tg "$tg" --reps "$reps" --out "$out" ${COMMIT:+--commit "$COMMIT"} 2>&1 | tee "$out/peer.log"
    ;;
*)
    sed -n '2,22p' "$0" >&2
    exit 2
    ;;
esac
