#!/usr/bin/env bash
# Here, before bench/device_check.sh: what the device machine lacks, into .device/
# (gitignored; the `run` call names it in `carry`). Its image has Python 3.12, PyTorch and
# transformers, but none of these packages, and nothing can be fetched there; the packaged
# model (94 MB) is over a call's 64 MiB, so only its config and tokenizer travel
# (bench/random_model.py gives it random weights there). PYTHON_VERSION: the device's (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES='^(msgspec|pydantic|pydantic[-_]core|pydantic[-_]settings|python[-_]dotenv|annotated[-_]types|typing[-_]inspection|redis|fakeredis|PyJWT)=='
rm -rf .device && mkdir -p .device/wheels
.venv/bin/pip freeze | grep -iE "$PACKAGES" > .device/requirements.txt
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/wheels -r .device/requirements.txt
.venv/bin/python bench/random_model.py --no-weights .device/model
du -sh .device
