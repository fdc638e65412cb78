#!/usr/bin/env bash
# bench/workloads.py against llama.cpp's llama-server and `redserve up` (default settings),
# each alone on the machine and freshly started, then the ratios (redserve over llama-server).
#
#   LLAMA_SERVER=/tmp/peers/.../build/bin/llama-server bash bench/workloads.sh
#
# Extra `redserve up` flags in $REDSERVE_FLAGS. Tables and JSON land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/redserve-workloads}
mkdir -p "$OUT"
GGUF=$($PY -c "from shared.model_files import default_gguf_path; print(default_gguf_path())")
TOK=$($PY -c "from shared.model_files import resolve_model; print(resolve_model(''))")

wait_ready() {
    for _ in $(seq 900); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done
    echo "no answer from $1" >&2; return 1
}
measure() {  # label url
    $PY bench/workloads.py --url "$2" --tokenizer "$TOK" --label "$1" --out "$OUT/$1.json" \
        | tee "$OUT/$1.md"
}
stop() { kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

"$LLAMA_SERVER" -m "$GGUF" -c 65536 --parallel 16 --port 8080 >"$OUT/llama-server.log" 2>&1 &
pid=$!
wait_ready http://127.0.0.1:8080 && measure llama-server http://127.0.0.1:8080
stop $pid
# shellcheck disable=SC2086
.venv/bin/redserve up --port 30000 ${REDSERVE_FLAGS:-} >"$OUT/redserve.log" 2>&1 &
pid=$!
wait_ready http://127.0.0.1:30000 && measure redserve http://127.0.0.1:30000
stop $pid
$PY bench/workloads.py --compare "$OUT/llama-server.json" "$OUT/redserve.json" | tee "$OUT/compare.md"
