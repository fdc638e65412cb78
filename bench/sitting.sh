#!/usr/bin/env bash
# One sitting: llama.cpp's llama-server, then `redserve up` (default settings), then
# `redserve up --quantization int4` and `--quantization w8a8_int8` (or $QUANTIZATIONS), each
# alone on the machine, through bench/serving.py at concurrency 1, 4, 16 and 64 (128 prompt
# tokens, 128 output tokens, greedy, streaming).
#
#   LLAMA_SERVER=/tmp/peers/.../build/bin/llama-server bash bench/sitting.sh
#
# With COMPILE_MAX_BS=N each mode also runs with `--enable-torch-compile
# --torch-compile-max-bs N` (as redserve-<mode>-compiled). With KV_CACHE_DTYPES="auto bfloat16"
# each mode runs once per `--kv-cache-dtype` (as redserve-<mode>[-kv<dtype>]).
#
# Tables (markdown) and rows (JSON) land in $OUT (default /tmp/redserve-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/redserve-bench}
CONCURRENCY=${CONCURRENCY:-1 4 16 64}
mkdir -p "$OUT"
GGUF=$($PY -c "from shared.model_files import default_gguf_path; print(default_gguf_path())")
TOK=$($PY -c "from shared.model_files import resolve_model; print(resolve_model(''))")

port_free() {  # a server left running on the port would be measured in place of ours
    if curl -sf "$1/v1/models" >/dev/null; then echo "something already answers at $1" >&2; exit 1; fi
}

wait_ready() {  # an OpenAI server answers /v1/models (compiling for 32 sequences on 2 AVX2 cores: minutes)
    for _ in $(seq 900); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done
    echo "no answer from $1" >&2; return 1
}

measure() {  # name url
    # shellcheck disable=SC2086
    $PY -m bench.serving --url "$2" --tokenizer "$TOK" --concurrency $CONCURRENCY \
        --out "$OUT/$1.json" | tee "$OUT/$1.md"
}

stop() { kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

if [ -n "${LLAMA_SERVER:-}" ]; then
    port_free http://127.0.0.1:8080
    "$LLAMA_SERVER" -m "$GGUF" --parallel 16 -c 8192 --port 8080 >"$OUT/llama-server.log" 2>&1 &
    pid=$!
    wait_ready http://127.0.0.1:8080 && measure llama-server http://127.0.0.1:8080
    stop $pid
fi
serve() {  # name flags...
    local name=$1
    shift
    port_free http://127.0.0.1:30000
    .venv/bin/redserve up --port 30000 "$@" >"$OUT/$name.log" 2>&1 &
    pid=$!
    wait_ready http://127.0.0.1:30000 && measure "$name" http://127.0.0.1:30000
    stop $pid
}

for quantization in ${QUANTIZATIONS:-none int4 w8a8_int8}; do
    for kv in ${KV_CACHE_DTYPES:-auto}; do
        name=redserve-$quantization
        [ "$kv" = auto ] || name=$name-kv$kv
        serve "$name" --quantization "$quantization" --kv-cache-dtype "$kv"
        if [ -n "${COMPILE_MAX_BS:-}" ]; then
            serve "$name-compiled" --quantization "$quantization" --kv-cache-dtype "$kv" \
                --enable-torch-compile --torch-compile-max-bs "$COMPILE_MAX_BS"
        fi
    done
done
