# Hugging Face transformers' continuous batching, instrumented by TransformersInstrumentor
# (tests/transformers), on the newest and the oldest transformers release of the supported range
# (otel_llm/integrations/transformers/package.py, read here), each in a venv of its own. Included from the
# Makefile; each target sets itself up on a fresh machine, behind a stamp file.
# torch first and pinned (an unpinned one pulls a CUDA build); psutil, or transformers' offloading
# manager warns at every run; [serving] for `transformers serve`; oteltest: the OTLP sink.
PYTHON ?= python3
TRANSFORMERS_NEWEST ?= $(shell $(PYTHON) otel_llm/integrations/transformers/package.py newest)
TRANSFORMERS_OLDEST ?= $(shell $(PYTHON) otel_llm/integrations/transformers/package.py oldest)
TRANSFORMERS_ARGS ?=
TRANSFORMERS_DEPS = torch==2.13.0 "pytest>=8" "oteltest>=0.40" psutil

.PHONY: test-transformers test-transformers-newest test-transformers-oldest bench-transformers demo-transformers clean-transformers

# $(1): venv, $(2): transformers version
define transformers_venv
$(1)/.ready-transformers-$(2): pyproject.toml
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	rm -f $(1)/.ready-transformers-*
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q "transformers[serving]==$(2)" $(TRANSFORMERS_DEPS) -e '.[transformers]'
	touch $$@
endef

$(eval $(call transformers_venv,.venv-transformers,$(TRANSFORMERS_NEWEST)))
$(eval $(call transformers_venv,.venv-transformers-oldest,$(TRANSFORMERS_OLDEST)))

# The editable install is re-run (cheap, no deps) so that a change to pyproject's entry points
# reaches the cached venv.
test-transformers: test-transformers-newest test-transformers-oldest

test-transformers-newest: .venv-transformers/.ready-transformers-$(TRANSFORMERS_NEWEST)
	.venv-transformers/bin/python -m pip install -q --no-deps -e .
	HF_HUB_OFFLINE=1 .venv-transformers/bin/python -m pytest -q -p no:cacheprovider tests/transformers $(TRANSFORMERS_ARGS)

test-transformers-oldest: .venv-transformers-oldest/.ready-transformers-$(TRANSFORMERS_OLDEST)
	.venv-transformers-oldest/bin/python -m pip install -q --no-deps -e .
	HF_HUB_OFFLINE=1 .venv-transformers-oldest/bin/python -m pytest -q -p no:cacheprovider tests/transformers $(TRANSFORMERS_ARGS)

clean-transformers:
	rm -rf .venv-transformers .venv-transformers-oldest

# The instrumentor's cost (bench/transformers.py; rotel: the OTLP receiver), into bench/results.json.
bench-transformers: .venv-transformers/.ready-transformers-$(TRANSFORMERS_NEWEST)
	.venv-transformers/bin/python -m pip install -q --no-deps -e .
	.venv-transformers/bin/python -m pip install -q "rotel>=0.0.1a15"
	.venv-transformers/bin/python -m bench.transformers $(TRANSFORMERS_ARGS)

# `make demo`'s summary on transformers' continuous batching (otel-llm demo --engine transformers).
demo-transformers: .venv-transformers/.ready-transformers-$(TRANSFORMERS_NEWEST)
	.venv-transformers/bin/python -m pip install -q --no-deps -e .
	.venv-transformers/bin/otel-llm demo --engine transformers --prometheus-port 0 $(ARGS)
