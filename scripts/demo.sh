#!/usr/bin/env bash
# `make demo`: the main job end to end on a tiny built-in model: synthesize a Qwen3-MoE-shaped GGUF,
# pack it, verify it, start expertd on it, stream every expert through the client library (each
# checked against the manifest's sha256), show `expertctl stats`, stop the daemon with SIGTERM.
set -euo pipefail
bin=.venv/bin
out=demo-out
rm -rf "$out" && mkdir -p "$out"
"$bin/expertpack" synth --preset tiny -o "$out/tiny.gguf"
"$bin/expertpack" build "$out/tiny.gguf" -o "$out/tiny.expertpack"
"$bin/expertpack" verify "$out/tiny.expertpack"
"$bin/expertpack" inspect "$out/tiny.expertpack"

endpoint="ipc://$PWD/$out/expertd.sock"
"$bin/expertd" --pack "$out/tiny.expertpack" --endpoint "$endpoint" --stage-slots 16 --client-slots 8 &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$out/expertd.sock" ] && break; sleep 0.1; done
"$bin/python" - "$endpoint" "$out/tiny.expertpack" <<'PY'
import hashlib, sys, time
from expertpack.client import ExpertClient
from expertpack.packtools.layout import Manifest
endpoint, pack = sys.argv[1], sys.argv[2]
m = Manifest.load(pack)
keys = [(l.layer, e) for l in m.layers for e in range(m.model.n_expert)]
start = time.perf_counter()
with ExpertClient(endpoint, name="demo", expect_fingerprint=m.fingerprint) as client:
    for expert in client.fetch(keys):
        assert hashlib.sha256(expert.data).hexdigest() == m.layer(expert.key.layer).sha256[expert.key.expert]
        expert.release()
print(f"streamed all {len(keys)} experts through expertd in {time.perf_counter() - start:.3f} s, "
      "each byte-identical to the pack (sha256)")
PY
"$bin/expertctl" stats --endpoint "$endpoint"
kill -TERM "$daemon" && wait "$daemon"
trap - EXIT
echo "not yet: the worker (model compute, VRAM cache) and the HTTP API are still being built"
