"""Fixtures for the vLLM integration tests (run in the vLLM venv: `make test-vllm`).

vLLM 0.33's PyPI wheel is a CUDA build; on a CPU machine its plugin interface and stats
classes still import and run (docs/architecture.md, "Real components"). The environment must
be set before vLLM is imported: vllm.mk sets it, and this file sets the same defaults for a
bare `pytest tests/vllm`.
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
# The plugin builds its providers from the environment; the tests hand it their own instead
# (otel_llm.integrations.vllm.use_handle), and nothing may try to reach a collector.
os.environ["OTEL_METRICS_EXPORTER"] = "none"
os.environ["OTEL_TRACES_EXPORTER"] = "none"
# The deep hook is on by default; these tests start from the stat-logger path, and those of the
# deep hook turn it on (its default itself: test_vllm_deep_hook.py).
os.environ["OTEL_LLM_VLLM_DEEP_HOOK"] = "0"
# Replace mode is the default: these tests run the plugin beside vLLM's own logger, the truth
# they compare with; those of replace mode ask for it (test_vllm_replace.py).
os.environ["OTEL_LLM_VLLM_METRICS"] = "add"
for _var in ("OTEL_LLM_MODEL_NAME", "OTEL_LLM_PREEMPTION_BUCKETS", "VLLM_PLUGINS"):
    os.environ.pop(_var, None)

import pytest  # noqa: E402 - after the environment is cleaned above

# vLLM's request_num_preemptions boundaries: the parity test configures ours the same.
VLLM_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="session")
def vllm_config(model_dir: str):
    """A real VllmConfig around a hand-written tiny Llama config.json (no weights, no tokenizer)."""
    from vllm.config import ModelConfig

    from otel_llm.testing.vllm.config import class_level_config

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32")
    return class_level_config(model_config)


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch, vllm_config):
    """In-memory readers handed to the plugin; vLLM's global metrics and our globals reset after."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    import otel_llm
    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook
    from otel_llm.integrations.vllm.series.series import VllmSeries

    class Otel:
        def __init__(self, tenant_sources=None, **config_overrides):
            self.reader = InMemoryMetricReader()
            self.spans = InMemorySpanExporter()
            config = otel_llm.TelemetryConfig(
                model_name=vllm_config.model_config.served_model_name,
                max_model_len=vllm_config.model_config.max_model_len,
                metrics_exporters=("none",),
                traces_exporters=("none",),
                **config_overrides,
            )
            # vLLM's series beyond the core metrics need their Views on the provider.
            self.handle = otel_llm.setup_telemetry(
                config,
                extra_metric_readers=[self.reader],
                extra_span_processors=[SimpleSpanProcessor(self.spans)],
                extra_views=VllmSeries(vllm_config, [0], config.naming).views(),
                **({} if tenant_sources is None else {"tenant_sources": tenant_sources, "entry_point": "test"}),
            )
            plugin.use_handle(self.handle)

    made: list[Otel] = []

    def make(tenant_sources=None, **config_overrides) -> Otel:
        """``tenant_sources``: those the entry point under test hands over (setup_telemetry's)."""
        o = Otel(tenant_sources, **config_overrides)
        made.append(o)
        return o

    unregister_vllm_metrics()
    yield make
    plugin.reset()
    vllm_deep_hook.uninstall()
    unregister_vllm_metrics()
    for o in made:
        o.handle.shutdown()
