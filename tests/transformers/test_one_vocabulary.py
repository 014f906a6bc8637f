"""One vocabulary across engines: with the semconv profile, transformers' metrics have the names
and label keys of engine_stub's (the same table, the same tracker), and `gen_ai.provider.name`
tells the engines apart."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine_stub import Engine, EngineConfig
from otel_llm.testing import in_memory_telemetry
from tests.transformers.conftest import CONFIG, Instrumented, cb_config, generation_config, prompts


def vocabulary(snapshot: Any) -> dict[str, set[frozenset[str]]]:
    """Metric name -> the label-key sets of its points."""
    return {name: {frozenset(p.attributes) for p in points} for name, points in snapshot.items()}


def test_semconv_names_and_labels_equal_engine_stubs(model: Any, instrumented: Instrumented) -> None:
    model.generate_batch(
        inputs=prompts(8, seed=8),
        generation_config=generation_config(24),
        continuous_batching_config=cb_config(),
        warmup=False,
    )
    ours = vocabulary(instrumented.metrics())

    with in_memory_telemetry(dataclasses.replace(CONFIG, provider_name="engine_stub")) as stub:
        engine = Engine(EngineConfig(num_kv_blocks=8, block_size=16, max_num_seqs=8, load_plugins=False))
        engine.hooks.subscribe(stub.telemetry)
        for i, p in enumerate(prompts(8, seed=8)):
            engine.add_request(f"s{i}", [t % 256 for t in p], max_tokens=24)
        engine.run()
        theirs = vocabulary(stub.metrics())
        providers = {p.attributes.get("gen_ai.provider.name") for points in stub.metrics().values() for p in points}

    assert not any(name.startswith("vllm:") for name in ours)
    # Every series transformers has, engine_stub has under the same name with the same label keys.
    assert ours and {name: ours[name] for name in ours} == {name: theirs.get(name) for name in ours}
    assert set(theirs) - set(ours) <= {"otel_llm.dropped_events"}, set(theirs) - set(ours)
    assert providers - {None} == {"engine_stub"}
    ours_providers = {
        p.attributes.get("gen_ai.provider.name") for points in instrumented.metrics().values() for p in points
    }
    assert ours_providers - {None} == {"transformers"}
