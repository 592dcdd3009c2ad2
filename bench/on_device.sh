#!/usr/bin/env bash
# Runs the storage benchmarks on the lent GPU machine (see ../.library/device): build throughput
# against cp, and `expertpack bench io` (fio, expertd, buffered) on the machine's own disk.
# Needs, carried along: .whl (../shared/device/wheels.sh) and .devtools/fio (a static fio build;
# that machine has no package registry). Usage there: bash bench/on_device.sh LAYERS [build|io|both]
set -euo pipefail
layers=${1:-4}
what=${2:-both}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PWD/.devtools:$PATH" PYTHONUNBUFFERED=1
echo "== machine"; nproc; free -g | head -2; uname -r; df -h . | tail -1; fio --version
out=${OUT:-/tmp}
src="bench-out/deepseek-v4-flash-${layers}L.gguf"
if [ "$what" != io ]; then
  python3 bench/build_throughput.py --layers "$layers" --dir bench-out --keep-source 2>&1 | tee "$out/build.log"
fi
if [ "$what" != build ]; then
  [ -f "$src" ] || expertpack synth --preset deepseek-v4-flash --layers "$layers" -o "$src" -q
  expertpack build -q "$src" -o bench-out/pack --force
  expertpack bench io bench-out/pack 2>&1 | tee "$out/io.log"
fi
