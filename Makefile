# cancelbench: the README's two commands are `make demo` and `make test`.
# Both do every set-up step on a fresh machine: system packages (apt-get, where
# available and root), the venv, the llama-cpp-python wheel built from source
# into build/wheelhouse/<version>-<variant>/, the package with its native code,
# and the fixture models.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CPP_PYTHON_VERSION := 0.3.36
UNAME := $(shell uname -s)
HAVE_APT := $(shell command -v apt-get >/dev/null 2>&1 && [ -r /etc/debian_version ] && echo yes)
IS_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo yes)

# One llama-cpp-python build serves every agent on a host: the Vulkan build runs
# CPU agents too (no GPU layers, no visible Vulkan device). Override with
# LLAMA_VARIANT=cpu|vulkan|metal|cuda.
ifeq ($(UNAME),Darwin)
LLAMA_VARIANT ?= metal
else ifeq ($(HAVE_APT),yes)
LLAMA_VARIANT ?= vulkan
else
LLAMA_VARIANT ?= cpu
endif

# Debian packages the tests need: Chromium for the HTML report check, iproute2
# (`ip`) for the multi-host tests in network namespaces; the Vulkan runtime,
# shader compiler and lavapipe come from build_llama_wheel.sh; cJSON for the C
# protocol engine (native/sut_text_engine.c).
APT_PACKAGES := chromium iproute2 libcjson-dev

DEMO_OUT ?= results/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test test-all test-fast setup system-deps wheel fixtures bench clean

demo: setup fixtures
	$(BIN)/cancelbench sweep --config datasets/sweeps/demo.toml --out $(DEMO_OUT)

# CI's command (.ci/run): everything except the `measure` tests (rates over several real
# sweeps each: the anchors' hit rate under injected variance, trend across five sweeps),
# which `make test-all` adds. tests/conftest.py applies every marker.
test: setup fixtures
	$(BIN)/python -m pytest -q -m "not measure"

test-all: setup fixtures
	$(BIN)/python -m pytest -q

# The quick loop (a few minutes on 2 cores): no Ray, no network namespaces, no Vulkan,
# no browser, nothing slow. tests/conftest.py marks tests by what they start and fails
# one that starts Ray without the cluster marker.
FAST_MARKS := not cluster and not netns and not vulkan and not browser and not slow and not measure

test-fast: setup fixtures
	$(BIN)/python -m pytest -q -m "$(FAST_MARKS)"

# The benchmarks that run through the sweep path (benchmarks/harness.py): each
# writes benchmarks/results/<name>/ (a dataset) and <name>.json (its summary),
# then the report reproduces the JSON's figures. BENCH_ARGS (both scripts):
# --force replaces the committed results; BENCH_ARGS= refuses to overwrite them.
BENCH_ARGS ?= --force

bench: setup fixtures
	$(BIN)/python benchmarks/bench_mechanisms.py $(BENCH_ARGS)
	$(BIN)/cancelbench report benchmarks/results/mechanisms/
	$(BIN)/python benchmarks/bench_graph_eval.py $(BENCH_ARGS)
	$(BIN)/cancelbench report benchmarks/results/graph_eval_cpu/

SUT_ENGINE := build/sut/cancelbench-text-engine
# libcancelbench: the cancel token and its readers as a C library (header, .so, .a, .pc)
LIBCANCELBENCH := build/libcancelbench/lib/pkgconfig/cancelbench.pc

setup: system-deps $(VENV)/.stamp-install-$(LLAMA_VARIANT) $(LIBCANCELBENCH) $(SUT_ENGINE)

$(LIBCANCELBENCH): native/cancel_token.c native/cancel_token.h native/build_libcancelbench.sh
	FORCE=1 bash native/build_libcancelbench.sh

# The C protocol engine, linked against the installed wheel's libllama and libcancelbench.
$(SUT_ENGINE): native/sut_text_engine.c native/build_sut_engine.sh $(LIBCANCELBENCH) $(VENV)/.stamp-install-$(LLAMA_VARIANT) | system-deps
	PYTHON=$(BIN)/python FORCE=1 bash native/build_sut_engine.sh

system-deps:
ifeq ($(HAVE_APT)$(IS_ROOT),yesyes)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
else
	@echo "system-deps: no apt-get as root here; install $(APT_PACKAGES) yourself for the browser test"
endif

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel

WHEELHOUSE := build/wheelhouse/$(LLAMA_CPP_PYTHON_VERSION)-$(LLAMA_VARIANT)

wheel: $(BIN)/python
	PYTHON=$(BIN)/python bash native/build_llama_wheel.sh $(LLAMA_VARIANT)

# Reinstall when the variant or the project metadata changes.
$(VENV)/.stamp-install-$(LLAMA_VARIANT): pyproject.toml setup.py native/cancel_token.c native/cancel_token.h $(BIN)/python
	PYTHON=$(BIN)/python bash native/build_llama_wheel.sh $(LLAMA_VARIANT)
	$(BIN)/python -m pip install -q --no-deps --force-reinstall $(WHEELHOUSE)/llama_cpp_python-*.whl
	$(BIN)/python -m pip install -q -e '.[test]'
	echo $(LLAMA_VARIANT) > $@

fixtures: setup
	$(BIN)/cancelbench fixtures

clean:
	rm -rf $(VENV) build/wheelhouse *.egg-info native/*.so
