"""Run by tests/export/test_ray.py inside a network namespace of its own (loopback only): a local Ray
cluster whose actors are engine_stub replicas with the plugin, pushing OTLP/gRPC through rotel to a
sink. Prints what each replica served and what reached the sink, as JSON.

A local Ray cluster's servers listen on every interface; in the namespace that is loopback only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

import ray

from tests.support.backends import start_otlp_sink, start_rotel, wait_until


class Replica:
    """An engine_stub replica with the plugin, as Ray Serve would host a vLLM replica."""

    def __init__(self, otlp_endpoint: str, seed: int) -> None:
        from engine_stub import Engine, EngineConfig
        from otel_llm import TelemetryConfig
        from otel_llm.integrations.engine_stub import register

        actor_id = ray.get_runtime_context().get_actor_id()
        assert actor_id is not None  # set inside an actor
        self.actor_id = actor_id
        # The replica's identity on its resource: its Ray actor id.
        config = TelemetryConfig(
            model_name="tiny",
            metrics_exporters=("otlp",),
            traces_exporters=("otlp",),
            otlp_endpoint=otlp_endpoint,
            otlp_protocol="grpc",
            resource_attributes={"service.instance.id": self.actor_id, "ray.actor.id": self.actor_id},
        )
        self.engine = Engine(
            EngineConfig(
                num_kv_blocks=24,
                block_size=16,
                max_num_seqs=16,
                max_num_batched_tokens=128,
                seed=seed,
                load_plugins=False,
            )
        )
        self.handle = register(self.engine, config)  # also kept as engine.telemetry_handle

    @ray.method  # typed as a remote method: handle.serve.remote(...)
    def serve(self, requests: int) -> tuple[str, int, int]:
        for i in range(requests):
            self.engine.add_request(f"req-{i}", "the quick brown fox " * (1 + i % 5), max_tokens=24 + 8 * (i % 4))
        outputs = self.engine.run()
        self.handle.shutdown()  # flushes: a replica going away loses nothing
        return self.actor_id, len(outputs), sum(o.num_preemptions for o in outputs)


def main(replicas: int, requests: int) -> None:
    ray.init(num_cpus=replicas, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with start_otlp_sink("grpc") as sink, start_rotel(forward_to=sink.endpoint) as rotel:
            actor = ray.remote(num_cpus=1)(Replica)
            handles = [actor.remote(f"http://127.0.0.1:{rotel.grpc_port}", seed) for seed in range(replicas)]
            served = ray.get([h.serve.remote(requests) for h in handles], timeout=600)
            total = sum(n for _, n, _ in served)
            wait_until(lambda: len(sink.spans()) >= total, 60, interval=0.1, what="every span")

            def instances() -> set[str]:
                with sink.lock:
                    return {
                        a.value.string_value
                        for e in sink.metrics
                        for rm in e.resource_metrics
                        for a in rm.resource.attributes
                        if a.key == "service.instance.id"
                    }

            wait_until(lambda: len(instances()) >= replicas, 60, interval=0.1, what="every replica's metrics")
            seen: dict[str, dict[str, int | str | None]] = {}  # instance -> its actor id and metric totals
            with sink.lock:
                exports = list(sink.metrics)
            for export in exports:
                for rm in export.resource_metrics:
                    attrs = {a.key: a.value.string_value for a in rm.resource.attributes}
                    for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                        if m.name in ("vllm:request_success", "vllm:num_preemptions"):
                            # Cumulative: the last export of each process wins.
                            seen.setdefault(attrs["service.instance.id"], {"ray.actor.id": attrs.get("ray.actor.id")})[
                                m.name
                            ] = sum(p.as_int for p in m.sum.data_points)
            print(json.dumps({"served": served, "seen": seen, "spans": len(sink.spans())}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
