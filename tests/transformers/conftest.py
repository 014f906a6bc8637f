"""Fixtures for the transformers suite (`make test-transformers`, venvs .venv-transformers and
.venv-transformers-oldest): a tiny Llama with seeded random weights made here, its real continuous
batching with too little KV cache, TransformersInstrumentor on in-memory providers, and the
engine's ground truth observed without the instrumentor (engine_truth)."""

from __future__ import annotations

import collections
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import otel_llm
from otel_llm import TelemetryConfig
from otel_llm.integrations.transformers import TransformersInstrumentor
from otel_llm.testing import collect_metrics
from otel_llm.testing.models import VOCAB_SIZE, make_tiny_llama
from otel_llm.testing.read import MetricsSnapshot, spans_by_request

# One thread: two shared cores, and torch's threads contending with the engine's own thread
# made a 2 s run take 30 s here.
torch.set_num_threads(1)

CB_LOGGER = "ContinuousBatchingLogger"  # transformers' continuous-batching logger


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model(tiny_model_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa", dtype=torch.float32)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 8-40 token ids, seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(8, 40))] for _ in range(n)]


def generation_config(max_new_tokens: int = 48) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(num_blocks: int = 6) -> Any:
    """Too little KV cache at 6 blocks of 16 tokens: about one eviction per request."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=16, num_blocks=num_blocks, max_batch_tokens=128, max_requests_per_batch=16, allow_block_sharing=False
    )


@dataclass
class EngineTruth:
    """What the engine did, observed without the instrumentor: soft resets per request (each
    eviction builds the request anew through ``RequestState.create_equivalent_initial_request``),
    the engine's own log line per eviction round, and every token the model computed (a forward
    pre-hook)."""

    resets: collections.Counter = field(default_factory=collections.Counter)
    logged_evictions: int = 0
    forwarded_tokens: int = 0

    def preemptions(self, request_ids: Any) -> dict[str, int]:
        return {rid: self.resets[rid] for rid in request_ids}

    def recomputed_tokens(self, outputs: Any) -> int:
        """Tokens computed beyond one pass over each request (prompt and output, the last output
        token never being fed back): the work thrown away by evictions and redone."""
        return self.forwarded_tokens - sum(len(o.prompt_ids) + len(o.generated_tokens) - 1 for o in outputs)


class _EvictionLog(logging.Handler):
    def __init__(self, truth: EngineTruth) -> None:
        super().__init__(logging.INFO)
        self.truth = truth

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()  # "Offloaded 1 requests (0 to CPU, 1 soft reset): ..."
        if message.startswith("Offloaded "):
            self.truth.logged_evictions += int(message.split()[1])


@pytest.fixture
def engine_truth(model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineTruth]:
    from transformers.generation.continuous_batching.requests import RequestState

    truth = EngineTruth()
    original = RequestState.create_equivalent_initial_request

    def counted(state: Any) -> Any:
        truth.resets[state.request_id] += 1
        return original(state)

    monkeypatch.setattr(RequestState, "create_equivalent_initial_request", counted)

    def count_tokens(_module: Any, _args: Any, kwargs: Any) -> None:
        truth.forwarded_tokens += int(kwargs["input_ids"].shape[-1])

    hook = model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    logger = logging.getLogger(CB_LOGGER)
    handler, level = _EvictionLog(truth), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield truth
    finally:
        hook.remove()
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Instrumented:
    """TransformersInstrumentor on in-memory providers built with otel_llm's Views."""

    instrumentor: TransformersInstrumentor
    config: TelemetryConfig
    meter_provider: Any
    metric_reader: Any
    tracer_provider: Any
    span_exporter: Any

    def flush(self) -> None:
        for telemetry in self.instrumentor.telemetry.values():
            telemetry.flush()

    def metrics(self) -> MetricsSnapshot:
        self.flush()
        return collect_metrics(self.metric_reader, self.config.naming)

    def spans(self) -> dict[str, Any]:
        """The finished request spans by request id; exactly one per request id (asserted)."""
        self.flush()
        finished = [s for s in self.span_exporter.get_finished_spans() if "gen_ai.request.id" in (s.attributes or {})]
        by_id = spans_by_request(finished)
        assert len(by_id) == len(finished), "a request with two spans"
        return by_id


def instrument(config: TelemetryConfig) -> Instrumented:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = TransformersInstrumentor()
    instrumentor.instrument(config=config, meter_provider=meter_provider, tracer_provider=tracer_provider)
    return Instrumented(instrumentor, config, meter_provider, reader, tracer_provider, exporter)


CONFIG = TelemetryConfig(model_name="tiny", naming="semconv", provider_name="transformers")


@pytest.fixture
def instrumented() -> Iterator[Instrumented]:
    """Instrumented on fresh in-memory providers; uninstrumented after the test."""
    found = instrument(CONFIG)
    try:
        yield found
    finally:
        found.instrumentor.uninstrument()
        found.meter_provider.shutdown()
        found.tracer_provider.shutdown()
