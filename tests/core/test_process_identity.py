"""Every process that runs the telemetry has its own identity on its resource.

Many engine processes (vLLM API servers, data-parallel ranks, replicas) push to one collector:
without a distinct ``service.instance.id`` their series would be one series there, each export
overwriting the others'. The SDK's resource detection gives each process a UUID (renewed in a
forked child); a user-given one wins. These tests hold that contract for setup_telemetry.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_llm import TelemetryConfig, setup_telemetry


def _resource_attributes() -> dict:
    reader = InMemoryMetricReader()
    handle = setup_telemetry(
        TelemetryConfig(model_name="m", metrics_exporters=("none",), traces_exporters=("none",)),
        extra_metric_readers=[reader],
    )
    try:
        data = reader.get_metrics_data()
        assert data is not None
        (rm,) = data.resource_metrics
        return dict(rm.resource.attributes)
    finally:
        handle.shutdown()


def test_a_process_has_one_uuid_instance_id(clean_env):
    first, second = _resource_attributes(), _resource_attributes()
    assert first["service.instance.id"] == second["service.instance.id"]  # engines of one process
    assert uuid.UUID(first["service.instance.id"]).version == 4
    assert first["service.name"] == "otel-llm"


def test_child_processes_get_their_own_instance_id(clean_env):
    code = "from tests.core.test_process_identity import _instance_id; print(_instance_id())"
    ids = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(ids) == 2 and all(uuid.UUID(i) for i in ids)


def test_a_user_given_identity_and_service_name_win(clean_env):
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=replica-7,deployment.environment=prod")
    clean_env.setenv("OTEL_SERVICE_NAME", "vllm-llama")
    attributes = _resource_attributes()
    assert attributes["service.instance.id"] == "replica-7"
    assert attributes["service.name"] == "vllm-llama"
    assert attributes["deployment.environment"] == "prod"


def test_a_forked_child_gets_its_own_instance_id(clean_env):
    import multiprocessing

    parent = _resource_attributes()["service.instance.id"]
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child = pool.apply(_instance_id)
    assert child != parent and uuid.UUID(child)


def _instance_id() -> str:
    return _resource_attributes()["service.instance.id"]


def test_a_user_given_id_already_used_by_another_live_process_on_the_host_is_reported(clean_env, caplog):
    """The same id in two processes' OTEL_RESOURCE_ATTRIBUTES: the second says so in one warning."""
    instance = f"replica-{uuid.uuid4()}"
    code = (
        "import sys, os; os.environ['OTEL_RESOURCE_ATTRIBUTES'] = 'service.instance.id=' + sys.argv[1]; "
        "from tests.core.test_process_identity import _instance_id; print(_instance_id(), flush=True); "
        "sys.stdin.read()"
    )  # holds its id until the test closes stdin
    holder = subprocess.Popen(
        [sys.executable, "-c", code, instance], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdin is not None and holder.stdout is not None  # both piped
    try:
        assert holder.stdout.readline().strip() == instance  # the holder has set up its telemetry
        clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", f"service.instance.id={instance}")
        with caplog.at_level("WARNING", logger="otel_llm.export.identity"):
            assert _instance_id() == instance  # the user's id is kept
            _instance_id()  # reported once per process
        said = [r.getMessage() for r in caplog.records if r.name == "otel_llm.export.identity"]
        assert len(said) == 1 and instance in said[0] and str(holder.pid) in said[0]
    finally:
        holder.stdin.close()
        holder.wait(60)
    fresh = f"replica-{uuid.uuid4()}"  # an id nobody holds: no warning
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", f"service.instance.id={fresh}")
    caplog.clear()
    assert _instance_id() == fresh and not [r for r in caplog.records if r.name == "otel_llm.export.identity"]
