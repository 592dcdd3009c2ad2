#!/usr/bin/env bash
# One call on the lent GPU machine (see ../.library/device) that checks and measures the GPU path:
# starts the llama.cpp build in the background (bench/peer_on_device.sh), meanwhile runs the kernel
# and GPU tests on a fixture subset and profiles a decode step, then runs the peer comparison once
# the build is done. About 7 minutes. Prepare here, then carry .whl, .peer and .gpufix:
#   bash ../shared/device/wheels.sh jinja2 markupsafe openai httpx2 httpcore2 truststore distro jiter sniffio certifi idna
#       # .whl (the machine reaches no registry; openai: tests/worker helpers that tests/kernels import)
#   .venv/bin/python bench/peer_llamacpp.py fetch --dest .peer/llama.cpp
#   bash bench/device_check.sh fixtures [SET]              # .gpufix: SET a (default, 22 MiB) or b (48 MiB)
# The tree that travels to the machine is at most 64 MiB, so tests/fixtures (105 MB) must not: keep it
# out of the checkout you run from (git sparse-checkout set --no-cone '/*' '!/tests/fixtures/') and
# take the set from another copy (EXPERTPACK_FIXTURES=../shared/fixtures).
# and on the device: COMMIT=<hash> bash bench/device_check.sh run
# `bash bench/device_check.sh iquants` (needs .whl, set a, .peer): the i-quant tests on CUDA and the expert
# kernels' bandwidth at IQ2_XXS and IQ1_S; it starts the llama.cpp build for the peer run that follows.
# `bash bench/device_check.sh workers [FLAGS]` (needs .whl only) measures N worker processes, one per
# visible GPU, on one expertd against one worker alone (bench/decode_workers.py FLAGS): the SSD path
# (no RAM tier), then expertd's default RAM tier; `workers-test` runs tests/gpu/test_two_workers.py
# (two GPUs, tiny model, argmax and shared reads); each fits one call.
# `bash bench/device_check.sh streaming` (needs .whl and set a) runs the expert cache's GPU tests, then
# bench/profile_streaming.py and decode_streaming.py with a RAM tier on the 12-layer Qwen3-30B-A3B.
# `bash bench/device_check.sh tier` (needs .whl and set a) runs the device table's GPU tests, then
# decode_streaming.py over a warm RAM tier (a pass to warm it, then the measured one; TIER_GIB), copies
# ahead off and on, with a 1 GiB cache (the warm tier's row in BENCHMARKS.md) and with the cache
# peer_offload.py gives the 4 / 8 GiB split (2.451 GiB; CACHE_GIB overrides both). About 7 minutes.
# `bash bench/device_check.sh prefill` (needs .whl only) sweeps which kernels a prompt of 32 and of 512
# tokens takes (attention, trunk matvec rows, expert paths) on the 12-layer Qwen3-30B-A3B.
# `bash bench/device_check.sh kernels PRESET LAYERS` (needs .whl only) shows where that preset's resident
# step goes: the decode step's and a 32-token prompt's profiles, one MoE layer of a prefill by path and
# prompt length (bench/moe_prefill.py), and a sweep of the expert and trunk kernels' tile settings.
# `bash bench/device_check.sh flagship PRESET LAYERS FULL_LAYERS CACHE_GIB [FLAGS]` (needs .whl only; one
# call each, ~6 min) streams the preset at its real shapes, cut to LAYERS, through expertd with
# CACHE_GIB of VRAM cache, prefetch off and on, beside every expert resident
# (bench/decode_streaming.py), then projects it with `expertpack plan --layers FULL_LAYERS` onto
# this machine and onto the reference one (RTX 5090: 32 GiB, PCIe 5 at this machine's 55 GB/s, an
# SSD at 13 GB/s, 13 GiB of RAM tier; its decode compute the H200's times 1.79/4.8 TB/s of memory
# bandwidth, decode being bound by it). E.g. deepseek-v4-flash 2 43 1.1 / kimi-k3 2 93 0.25; FLAGS
# --type IQ1_S --mix down=IQ2_XXS give the experts an i-quant mix (issue 36).
# Set a holds the quantized fixtures, which tests/kernels and most of tests/gpu read; set b the full
# precision ones (the four fixture models against transformers, DeepSeek-V4's BF16 graph buffers):
# `tests` with it, carried without .peer. `tests` deselects what the carried set lacks.
# Outputs (profiles, llama-bench JSON, chart) go to $OUT.
set -uo pipefail
fixtures=${EXPERTPACK_FIXTURES:-tests/fixtures}  # the copy to take a set from
install() {  # the project and the carried wheels, on a machine that reaches no registry
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
}
case "${1:-}" in
fixtures)
    set -e
    rm -rf .gpufix && mkdir -p .gpufix
    copy() { mkdir -p ".gpufix/$(dirname "$1")" && cp -r "$fixtures/$1" ".gpufix/$1"; }
    if [ "${2:-a}" = a ]; then
        for f in gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf gguf/gptoss-a/gptoss-a.MXFP4_MOE.gguf \
                 gguf/deepseek3-a/deepseek3-a.Q2_K.gguf gguf/mixtral-a/mixtral-a.Q4_K_M.gguf \
                 flagship/deepseek4/dsv4-tiny.Q2_K.gguf \
                 flagship/kimi-k3/k3-tiny.Q2_K.gguf flagship/kimi-k3/logits flagship/kimi-k3/reference.json; do
            copy "$f"
        done
        for m in qwen3moe-a gptoss-a; do
            for f in hf_logits_f32.npy hf_ref.json prompt_ids.npy; do copy "ref/$m/$f"; done
        done
    else
        for f in gguf/qwen3moe-a/qwen3moe-a.BF16.gguf gguf/mixtral-a/mixtral-a.F16.gguf \
                 gguf/deepseek3-a/deepseek3-a.BF16.gguf gguf/gptoss-a/gptoss-a.MXFP4.gguf \
                 flagship/deepseek4/dsv4-tiny.BF16.gguf flagship/deepseek4/logits flagship/deepseek4/reference.json; do
            copy "$f"
        done
        for m in qwen3moe-a mixtral-a deepseek3-a gptoss-a; do
            for f in hf_logits_f32.npy hf_ref.json prompt_ids.npy; do copy "ref/$m/$f"; done
        done
    fi
    du -sh .gpufix
    ;;
workers)
    install
    shift
    n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    out=${OUT:-/tmp}
    common=(--workers "$n" --layers 12 --cache-gib 1 --prompt 16 --decode 24 "$@")
    echo "== $n workers, no RAM tier (every miss of a worker's cache read from the SSD)"
    timeout 330 python3 bench/decode_workers.py "${common[@]}" --ram-cache-gib 0 2>&1 | grep -v Warn \
        | tee "$out/workers-ssd.txt" | tail -12
    echo "== $n workers, expertd's default RAM tier (shared)"
    timeout 220 python3 bench/decode_workers.py "${common[@]}" 2>&1 | grep -v Warn | tee "$out/workers-ram.txt" | tail -12
    ;;
flagship)
    install
    preset=$2 layers=$3 full=$4 cache=$5 out=${OUT:-/tmp}
    shift 5  # the rest goes to decode_streaming.py (e.g. --routing-skew 0.5, --prefetch on)
    mkdir -p bench-out
    timeout "${STREAM_TIMEOUT:-420}" python3 bench/decode_streaming.py --preset "$preset" --layers "$layers" \
        --cache-gib "$cache" --prompt 16 --decode 24 "$@" 2>&1 | grep -v Warn | tee "$out/flagship-$preset.txt" | tail -12
    resident=$(tail -1 "$out/flagship-$preset.txt" | python3 -c 'import json,sys; print(json.load(sys.stdin)["resident"]["decode_tokens_per_s"])')
    disk=$(tail -1 "$out/flagship-$preset.txt" | python3 -c 'import json,sys; print(json.load(sys.stdin)["disk_gb_per_s"])')
    pack=$(ls -d bench-out/"$preset"-"$layers"L*.pack | head -1)  # the one decode_streaming.py made
    echo "== projected onto $full layers: this machine (disk as measured: $disk GB/s)"
    expertpack plan "$pack" --layers "$full" --compute-tok-s "$resident" --disk-gbps "$disk" --pcie-gbps 55 \
        --json | tee "$out/plan-$preset-h200.json" | python3 -c 'import json,sys; p=json.load(sys.stdin)["plan"]; print({k: p[k] for k in ("slots","ram_slots","hit_rate","ram_hit_rate","tok_s_today","tok_s_overlapped","bound")})'
    echo "== projected onto $full layers: the reference machine"
    expertpack plan "$pack" --layers "$full" --vram-gib 31.84 --ram-gib 13 --disk-gbps 13 --pcie-gbps 55 \
        --compute-tok-s "$(python3 -c "print($resident * 1.79 / 4.8)")" --json | tee "$out/plan-$preset-ref.json" \
        | python3 -c 'import json,sys; p=json.load(sys.stdin)["plan"]; print({k: p[k] for k in ("slots","ram_slots","hit_rate","ram_hit_rate","tok_s_today","tok_s_overlapped","bound")})'
    ;;
streaming)  # the streaming path's GPU tests, then its host cost and its speed against the I/O bound
    install
    export EXPERTPACK_FIXTURES=$PWD/.gpufix
    out=${OUT:-/tmp}
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_expert_cache_cuda.py tests/gpu/test_multi_gpu.py \
        2>&1 | tail -3
    timeout 200 python3 bench/profile_streaming.py --layers 12 --cache-gib 1 --tokens 16 2>&1 | grep -v Warn \
        | tee "$out/profile_streaming.txt" | head -10
    timeout 200 python3 bench/decode_streaming.py --layers 12 --cache-gib 1 --ram-cache-gib 4 --prompt 16 --decode 24 \
        2>&1 | grep -v Warn | tee "$out/decode_streaming.txt" | tail -10
    ;;
tier)  # the table's GPU tests, then decode over a warm RAM tier (kept blocks read where they lie)
    install
    export EXPERTPACK_FIXTURES=$PWD/.gpufix
    out=${OUT:-/tmp}
    timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_segmented_graphs.py tests/gpu/test_expert_cache_cuda.py \
        tests/kernels/test_decode_kernels.py -k "table or expert_lookup or cache" 2>&1 | tail -3
    for cache in ${CACHE_GIB:-1 2.451}; do
        echo "== cache $cache GiB"
        timeout 200 python3 bench/decode_streaming.py --layers 12 --cache-gib "$cache" --ram-cache-gib "${TIER_GIB:-4}" \
            --prompt 32 --decode 64 --passes 2 --prefetch both --skip-resident 2>&1 | grep -v Warn \
            | tee "$out/decode_tier_$cache.txt" | grep -E "^(streaming|PCIe|copied|argmax)"
    done
    ;;
prefill)  # the paths a prompt's shape takes, swept on the resident step (bench/decode_settings.py --prefill)
    install
    out=${OUT:-/tmp}
    m=bench-out/qwen3-30b-a3b-12L.gguf
    mkdir -p bench-out && { [ -f $m ] || expertpack synth --preset qwen3-30b-a3b --layers 12 -o $m -q; }
    experts=("nn.moe.TILES_MIN_PAIRS_PER_EXPERT=3" "nn.moe.DENSE_MIN_PAIRS_PER_EXPERT=2")  # pp32: per pair, dense
    for n in 32 512; do
        echo "== prefill of $n tokens"
        timeout 250 python3 bench/decode_settings.py $m --prefill $n "" "layers.DECODE_MAX_QUERIES=$n" \
            "linear_tl.MATVEC_MAX_ROWS=$n" "layers.DECODE_MAX_QUERIES=$n linear_tl.MATVEC_MAX_ROWS=$n" \
            "${experts[@]}" 2>&1 | grep -v Warn | tee "$out/prefill-$n.txt"
        experts=("nn.moe.DENSE_MIN_PAIRS_PER_EXPERT=64")  # pp512 (32 pairs an expert): tiles instead of dense
    done
    ;;
kernels)  # where one preset's resident step goes, and which kernel settings suit its shapes
    install
    out=${OUT:-/tmp}
    m=bench-out/${2:?kernels PRESET LAYERS}-${3:?kernels PRESET LAYERS}L.gguf
    mkdir -p bench-out && { [ -f "$m" ] || expertpack synth --preset "$2" --layers "$3" -o "$m" -q; }
    echo "== decode step"; timeout 120 python3 bench/profile_decode.py "$m" 2>&1 | grep -v Warn | tee "$out/profile-$2.txt" | head -10
    echo "== a 32-token prompt, eager"; timeout 120 python3 bench/profile_decode.py "$m" --prefill 32 --steps 3 --eager \
        2>&1 | grep -v Warn | tee "$out/profile-prefill-$2.txt" | head -8
    echo "== one MoE layer of a prefill"; timeout 150 python3 bench/moe_prefill.py "$m" --tokens 8,32,128,512 2>&1 \
        | grep -v Warn | tee "$out/moe_prefill-$2.txt" | head -8
    echo "== decode settings"; timeout 200 python3 bench/decode_settings.py "$m" "" "moe_tl.BN=8" "moe_tl.BN=32" \
        "moe_tl.PROGRAMS_PER_SM=16" "moe_tl.PROGRAMS_PER_SM=64" "linear_tl.PROGRAMS_PER_SM=8" 2>&1 | grep -v Warn \
        | tee "$out/settings-$2.txt" | grep -v '^{'
    ;;
iquants)  # issue 36 on the GPU: the i-quant kernel and GPU tests, then the expert kernels' bandwidth at
    # IQ2_XXS and IQ1_S beside Q4_K (2-layer Qwen3-30B-A3B); starts the llama.cpp build for a following
    # `TYPE=IQ2_XXS bash bench/peer_on_device.sh run qwen3-30b-a3b 12` (needs .whl, set a, .peer)
    bash bench/peer_on_device.sh start-build
    install
    export EXPERTPACK_FIXTURES=$PWD/.gpufix
    out=${OUT:-/tmp}
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_i_quants_cuda.py tests/gpu/test_batched_decode_cuda.py \
        tests/kernels -k "IQ or TQ or iq or tq" 2>&1 | tail -4
    mkdir -p bench-out
    for t in Q4_K IQ2_XXS IQ1_S; do
        m=bench-out/qwen3-30b-a3b-2L-$t.gguf
        [ -f "$m" ] || expertpack synth --preset qwen3-30b-a3b --layers 2 --type $t -o "$m" -q
        echo "== $t"; timeout 120 python3 bench/kernel_bandwidth.py "$m" 2>&1 | grep -v Warn | tee "$out/bandwidth-$t.txt" \
            | grep -v '^{' | head -12
    done
    ;;
workers-test)
    install
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_two_workers.py 2>&1 | tail -6
    ;;
run | tests)
    [ "$1" = run ] && bash bench/peer_on_device.sh start-build
    install
    export EXPERTPACK_FIXTURES=$PWD/.gpufix
    echo "== tests (those whose fixtures are in .gpufix)"
    have() { [ -e ".gpufix/$1" ]; }
    skip=()
    for t in "qwen3moe-a:gguf/qwen3moe-a/qwen3moe-a.BF16.gguf" "gptoss-a:gguf/gptoss-a/gptoss-a.MXFP4.gguf" \
             "mixtral-a:gguf/mixtral-a/mixtral-a.F16.gguf" "deepseek3-a:gguf/deepseek3-a/deepseek3-a.BF16.gguf"; do
        have "${t#*:}" || skip+=(--deselect "tests/gpu/test_cuda_worker.py::test_architectures_on_cuda_match_transformers[${t%%:*}]")
    done
    have flagship/deepseek4/reference.json || skip+=(--deselect tests/gpu/test_cuda_worker.py::test_deepseek4_on_cuda_matches_transformers)
    have flagship/kimi-k3/reference.json || skip+=(--deselect tests/gpu/test_cuda_worker.py::test_kimi_k3_on_cuda_matches_its_float64_reference)
    for m in gguf/qwen3moe-a/qwen3moe-a.Q4_K_M gguf/gptoss-a/gptoss-a.MXFP4_MOE gguf/deepseek3-a/deepseek3-a.Q2_K \
             flagship/kimi-k3/k3-tiny.Q2_K flagship/deepseek4/dsv4-tiny.BF16; do
        have "$m.gguf" || skip+=(--deselect "tests/gpu/test_decode_graph.py::test_graph_replays_equal_the_eager_static_steps[$m.gguf]")
    done
    have gguf/qwen3moe-a/qwen3moe-a.Q4_K_M.gguf || skip+=(--deselect tests/gpu/test_expert_cache_cuda.py
        --deselect tests/gpu/test_cuda_worker.py::test_resident_experts_equal_read_per_use_on_cuda
        --deselect tests/gpu/test_multi_gpu.py::test_two_gpus_through_expertd_share_one_connection)
    have gguf/mixtral-a/mixtral-a.Q4_K_M.gguf || skip+=(
        --deselect "tests/gpu/test_batched_decode_cuda.py::test_batched_steps_on_cuda_give_each_sequence_its_own_tokens[mixtral]"
        --deselect "tests/gpu/test_batched_decode_cuda.py::test_a_prompt_beside_running_sequences_on_cuda[mixtral]")
    for m in flagship/kimi-k3/k3-tiny.Q2_K flagship/deepseek4/dsv4-tiny.Q2_K; do
        have "$m.gguf" || skip+=(--deselect "tests/gpu/test_decode_graph.py::test_a_second_request_with_states_replays_the_graph[$m.gguf]")
    done
    for m in gguf/qwen3moe-a/qwen3moe-a.Q4_K_M gguf/gptoss-a/gptoss-a.MXFP4_MOE gguf/deepseek3-a/deepseek3-a.Q2_K \
             flagship/kimi-k3/k3-tiny.Q2_K flagship/deepseek4/dsv4-tiny.Q2_K; do
        have "$m.gguf" || { skip+=(--deselect tests/gpu/test_segmented_graphs.py); break; }  # its packs: set a's
    done
    skip+=(--deselect tests/gpu/test_two_workers.py)  # workers-test runs it (several processes; minutes)
    if [ "$1" = tests ]; then timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q tests/kernels tests/gpu -p no:cacheprovider "${skip[@]}" 2>&1 | tail -15; exit; fi
    timeout 240 python3 -m pytest -q tests/kernels tests/gpu -p no:cacheprovider "${skip[@]}" 2>&1 | tail -6
    out=${OUT:-/tmp}
    m=bench-out/qwen3-30b-a3b-12L.gguf
    mkdir -p bench-out && { [ -f $m ] || expertpack synth --preset qwen3-30b-a3b --layers 12 -o $m -q; }
    echo "== profile (CUDA graph)"; python3 bench/profile_decode.py $m 2>&1 | grep -v Warn | tee "$out/profile.txt" | head -16
    echo "== profile (prefill of 512 tokens)"; python3 bench/profile_decode.py $m --prefill 512 --steps 3 2>&1 | grep -v Warn | tee "$out/profile_prefill.txt" | head -14
    echo "== one MoE layer of a prefill"; python3 bench/moe_prefill.py $m 2>&1 | grep -v Warn | tee "$out/moe_prefill.txt" | head -9
    echo "== peer"; bash bench/peer_on_device.sh run qwen3-30b-a3b 12 64 2 2>&1 | tail -12
    ;;
*)
    sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
