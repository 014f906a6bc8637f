# vLLM integration tests (issue 7), in a venv of their own: vLLM's pins would fight the main one.
# Included from the Makefile; `make test-vllm` sets itself up on a fresh machine (DESIGN.md §7
# recipe: the PyPI wheel is a CUDA build, but vLLM's plugin interface and stats classes import
# and run on a CPU). The venv is cached behind a stamp file; delete it with `make clean-vllm`.
PYTHON ?= python3
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip
VLLM_PINS := tests/vllm/requirements.txt
VLLM_READY := $(VLLM_VENV)/.ready-vllm-0.33.0
VLLM_ARGS ?=

.PHONY: setup-vllm test-vllm clean-vllm

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

# The editable install is re-run every time (cheap, no deps) so that a change to pyproject's
# entry points reaches the cached venv.
test-vllm: $(VLLM_READY)
	$(VLLM_PIP) install -q --no-deps -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
	  VLLM_CACHE_ROOT=$$(mktemp -d) \
	  $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_ARGS)

clean-vllm:
	rm -rf $(VLLM_VENV)
