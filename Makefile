# The two commands: `make demo` and `make test`. Each sets itself up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_READY := $(VENV)/.ready-demo
READY := $(VENV)/.ready
ARGS ?=

.PHONY: demo test test-quick bench setup lint clean

include vllm.mk
include transformers.mk
include phoenix.mk

setup: $(READY)

# What the demo needs: the engine (torch) and the chart (matplotlib). torch first and pinned: an
# unpinned torch pulls a CUDA build of several GB.
$(DEMO_READY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine,plot]'
	touch $@

# What the tests need beside: the dev extras, Prometheus, valgrind (the bench's instruction counts).
$(READY): $(DEMO_READY)
	$(PIP) install -q -e '.[engine,dev]'
	command -v prometheus >/dev/null || { apt-get update -qq && apt-get install -y -qq prometheus; } \
	  || echo "warning: could not install prometheus (needs root); its tests will skip"
	command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; } \
	  || echo "warning: could not install valgrind (needs root); bench instruction counts will not run"
	touch $@

# /metrics stays up SERVE_SECONDS after the summary (Ctrl-C ends it); SERVE_SECONDS=0 skips that.
SERVE_SECONDS ?= 20
demo: $(DEMO_READY)
	$(VENV)/bin/otel-llm demo --serve-seconds $(SERVE_SECONDS) $(ARGS)

# tests/vllm, tests/vllm_engine and tests/transformers run in venvs of their own: `make test-vllm`
# (vllm.mk), `make test-transformers` (transformers.mk). Phoenix (phoenix.mk), the trace store of
# the drill-down tests, is set up first like the rest.
test: $(READY) $(PHOENIX_READY)
	$(PY) -m pytest -q --ignore=tests/vllm --ignore=tests/vllm_engine --ignore=tests/transformers $(ARGS)

# A quick subset, under a minute on 2 cores, for while one works: no test that needs a real backend
# (Prometheus, rotel, Phoenix: marked backend) and none of QUICK_SKIP, the modules that start
# processes or run long workloads. Needs no Phoenix.
QUICK_SKIP := tests/project/test_bench_smoke.py tests/project/test_bench_instructions.py \
  tests/project/test_makefile.py tests/engine/test_demo.py tests/core/test_testing_module.py \
  tests/reliability/test_reliability_cardinality.py tests/reliability/test_reliability_events.py \
  tests/reliability/test_reliability_lifecycle.py tests/reliability/test_reliability_sigterm.py \
  tests/reliability/test_reliability_security.py tests/reliability/test_heartbeat.py
test-quick: $(READY)
	$(PY) -m pytest -q -m 'not backend' tests/core tests/engine tests/export tests/project tests/reliability \
	  $(addprefix --ignore=,$(QUICK_SKIP)) $(ARGS)

# The same suite on the oldest OpenTelemetry SDK that pyproject allows (1.28.2, exporter-prometheus
# 0.49b2: constraints/sdk-oldest.txt), in a venv of its own; torch pinned first as above.
SDK_OLDEST_VENV ?= .venv-sdk-oldest
SDK_OLDEST_PY := $(SDK_OLDEST_VENV)/bin/python
SDK_OLDEST_PINS := constraints/sdk-oldest.txt
SDK_OLDEST_READY := $(SDK_OLDEST_VENV)/.ready

.PHONY: test-sdk-oldest
$(SDK_OLDEST_READY): pyproject.toml $(SDK_OLDEST_PINS)
	test -x $(SDK_OLDEST_PY) || $(PYTHON) -m venv $(SDK_OLDEST_VENV)
	$(SDK_OLDEST_PY) -m pip install -q torch==2.13.0
	$(SDK_OLDEST_PY) -m pip install -q -c $(SDK_OLDEST_PINS) -e '.[engine,dev]'
	command -v prometheus >/dev/null || { apt-get update -qq && apt-get install -y -qq prometheus; } \
	  || echo "warning: could not install prometheus (needs root); its tests will skip"
	touch $@

test-sdk-oldest: $(SDK_OLDEST_READY) $(PHOENIX_READY)
	$(SDK_OLDEST_PY) -m pytest -q --ignore=tests/vllm --ignore=tests/vllm_engine --ignore=tests/transformers $(ARGS)

# ruff (lint + format check) and mypy, pinned in the lint extra.
lint: $(VENV)/.lint-ready
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

$(VENV)/.lint-ready: $(READY)
	$(PIP) install -q -e '.[lint]'
	touch $@

bench: $(READY)
	$(PY) -m bench $(ARGS)

# collector/'s dashboards and rules, both naming profiles, from the metric table (collector/generate).
.PHONY: dashboards
dashboards: $(READY)
	$(PY) -m collector.generate

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
