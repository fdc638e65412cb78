#!/usr/bin/env bash
# On the device machine (after bench/device_prepare.sh here), as one `run` call:
#     run(command="bash bench/device_check.sh", carry=[".device"], timeout_s=540)
# What only a CUDA device shows: the graphed decode tests capture and replay real CUDA
# graphs (tests/model/test_cuda_graphs.py), and the engine's decode steps with and without
# them on a SmolLM2-135M-shaped model (random weights: a step's time does not depend on
# their values), beside HF generate(). Logs and tables land in $OUT.
# A dry run elsewhere: PYTHON=... DEVICE=cpu BATCHES="1 4" bash bench/device_check.sh
set -euo pipefail
OUT=${OUT:-/tmp/device-check} PYTHON=${PYTHON:-python3} DEVICE=${DEVICE:-cuda}
BATCHES=${BATCHES:-1 4 16 64}
mkdir -p "$OUT"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device/wheels/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L || true
"$PYTHON" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/model/test_cuda_graphs.py 2>&1 | tee "$OUT/pytest.log"
"$PYTHON" bench/random_model.py --source .device/model /tmp/model
for max_bs in 0 64; do
    skip_hf=$([ "$max_bs" = 0 ] && echo "" || echo --skip-hf)
    # shellcheck disable=SC2086  # BATCHES and skip_hf split into words on purpose
    "$PYTHON" bench/engine.py --model /tmp/model --device "$DEVICE" --dtype bfloat16 \
        --batch $BATCHES --cuda-graph-max-bs "$max_bs" $skip_hf 2>>"$OUT/engine.log" | tee -a "$OUT/engine.md"
done
