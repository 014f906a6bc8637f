# Arize Phoenix, the trace store of the drill-down (tests/export/test_drilldown.py and
# `make demo-stack`), in a venv of its own: about 850 MB, with pins of its own. Binary wheels only.
# Included from the Makefile; behind a stamp file.
PYTHON ?= python3
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_VERSION := 20.26.1
PHOENIX_READY := $(PHOENIX_VENV)/.ready-phoenix-$(PHOENIX_VERSION)

.PHONY: setup-phoenix

setup-phoenix: $(PHOENIX_READY)

$(PHOENIX_READY):
	test -x $(PHOENIX_VENV)/bin/python || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install -q --only-binary=:all: arize-phoenix==$(PHOENIX_VERSION)
	touch $@

# `make demo` against a local Prometheus and Phoenix: the drill-down from a bucket to its traces.
.PHONY: demo-stack
demo-stack: $(READY) $(PHOENIX_READY)
	$(VENV)/bin/otel-llm demo --stack --serve-seconds $(SERVE_SECONDS) $(ARGS)
