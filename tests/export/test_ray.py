"""Ray's metrics classes (Ray is vLLM's distributed back end; vLLM's Ray wrappers send its metrics
through ``ray.util.metrics``).

Ray's ``Histogram`` accepts our default preemption buckets and every bucket set our validation
accepts, and rejects the non-positive boundaries our validation rejects first (that is why our
boundaries start at 0.5, not 0). Ray's metric names have no ``:`` (Ray warns it will refuse
them), which is why vLLM's Ray wrappers send ``vllm:x`` as ``vllm_x``.

* Replicas as Ray actors on a local Ray cluster (tests/support/ray_replicas.py, in a network namespace of
  its own: a Ray cluster's servers listen on every interface, there only loopback): each actor runs
  engine_stub with the plugin, pushing OTLP/gRPC through rotel with its actor id as its
  ``service.instance.id``; per replica and in total, exact; one span per request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.util import metrics as ray_metrics

from otel_llm.config.buckets import REQUEST_NUM_PREEMPTIONS, validate_boundaries
from tests.support.backends import BackendUnavailable, backend

REPLICAS, REQUESTS = 2, 16


def test_rays_histogram_accepts_our_default_preemption_buckets_and_rejects_zero_as_we_do() -> None:
    ray_metrics.Histogram("request_num_preemptions_default", boundaries=list(REQUEST_NUM_PREEMPTIONS))
    with pytest.raises(ValueError, match="positive"):
        ray_metrics.Histogram("request_num_preemptions_zero", boundaries=[0, 1, 2])
    with pytest.raises(ValueError, match="<= 0"):
        validate_boundaries("preemption_buckets", [0, 1, 2])  # ours refuses it first, at config time


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=30,
        unique=True,
    )
)
def test_every_bucket_set_our_validation_accepts_ray_accepts(values: list[float]) -> None:
    bounds = validate_boundaries("preemption_buckets", sorted(values))
    histogram = ray_metrics.Histogram("request_num_preemptions_user", boundaries=list(bounds))
    histogram.observe(bounds[0])


def test_ray_metric_names_carry_no_colon_and_vllms_rule_maps_ours() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ray_metrics.Counter("vllm:num_preemptions")
    assert any(": character" in str(w.message) for w in caught)
    # vLLM's Ray wrappers (vllm/v1/metrics/ray_wrappers.py): every character outside [a-zA-Z0-9_] -> "_".
    name = re.sub(r"[^a-zA-Z0-9_]", "_", "vllm:request_num_preemptions")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the mapped name
        ray_metrics.Histogram(name, boundaries=list(REQUEST_NUM_PREEMPTIONS))


@pytest.mark.backend
def test_replicas_as_ray_actors_push_otlp_with_their_identity_and_add_up() -> None:
    script = Path(__file__).resolve().parents[1] / "support" / "ray_replicas.py"
    command = f"ip link set lo up && exec {sys.executable} {script} {REPLICAS} {REQUESTS}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_"))}
    with backend("ray"):
        try:
            run = subprocess.run(
                ["unshare", "--net", "--", "sh", "-c", command],
                capture_output=True,
                text=True,
                timeout=900,
                env=env,
                cwd=Path(__file__).resolve().parents[2],
            )
        except FileNotFoundError as exc:
            raise BackendUnavailable(f"unshare: {exc}") from None
        if run.returncode != 0:
            raise BackendUnavailable(f"ray cluster run failed ({run.returncode}): {run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    served = {actor_id: (n, p) for actor_id, n, p in result["served"]}
    assert sum(n for n, _ in served.values()) == REPLICAS * REQUESTS
    seen = {i: (v["vllm:request_success"], v["vllm:num_preemptions"]) for i, v in result["seen"].items()}
    assert seen == served  # each replica's own series, under its own identity, exact
    assert all(v["ray.actor.id"] == i for i, v in result["seen"].items())
    assert result["spans"] == REPLICAS * REQUESTS
