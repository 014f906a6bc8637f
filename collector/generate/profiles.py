"""The names a naming profile's series carry in Prometheus, derived from ``METRICS``.

The Prometheus exporters (the plugin's own endpoint and the Collector's) write an instrument name
with every character outside ``[a-zA-Z0-9_:]`` as ``_``, add the unit's suffix unless the name
already ends with it, and ``_total`` to counters; attribute keys are sanitized the same way
(``gen_ai.request.model`` -> ``gen_ai_request_model``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from otel_llm.catalogue.metrics import BY_KEY, MetricDef, label_key
from otel_llm.config import TelemetryConfig
from otel_llm.config.buckets import REQUEST_NUM_PREEMPTIONS

PROFILES = ("vllm", "semconv")
# A request that caused more preemptions than this is an evictor to alert on. The rule reads
# request_num_preemptions_caused_bucket{le="N"}: N must be one of the histogram's boundaries.
EVICTOR_THRESHOLD = 10.0

# Unit -> Prometheus name suffix, for the units the table uses ({...} annotations add none). A unit
# missing here stops the generator: its suffix must be looked up, not guessed.
_UNIT_SUFFIX = {"s": "seconds", "": "", "{preemption}": "", "{token}": "", "{request}": "", "{event}": ""}


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_:]", "_", name)


@dataclass(frozen=True)
class Profile:
    naming: str
    evictor_threshold: float = EVICTOR_THRESHOLD

    def __post_init__(self) -> None:
        if self.evictor_threshold not in REQUEST_NUM_PREEMPTIONS:
            raise ValueError(
                f"evictor threshold {self.evictor_threshold:g}: must be one of the preemption buckets' boundaries "
                f"{', '.join(f'{b:g}' for b in REQUEST_NUM_PREEMPTIONS)} (the rule reads the bucket le={{threshold}})"
            )

    @property
    def config(self) -> TelemetryConfig:
        return TelemetryConfig(naming=self.naming)

    def label(self, role: str) -> str:
        """The Prometheus label of ``role``: "model", "engine", or an extra label of the metric table."""
        return sanitize(label_key(self.config, role))

    @property
    def model(self) -> str:
        return self.label("model")

    @property
    def engine(self) -> str:
        return self.label("engine")

    @property
    def by(self) -> str:
        """The labels every expression keeps: one series per model and engine, processes summed."""
        return f"{self.model}, {self.engine}"

    @property
    def level(self) -> str:
        """The level part of a recording rule name (level:metric:operation): the labels kept."""
        return f"{self.model}_{self.engine}"

    def extra_label(self, key: str) -> str:
        metric = BY_KEY[key]
        assert metric.label is not None, key
        return self.label(metric.label)

    def base(self, key: str) -> str:
        """The series name before _bucket/_sum/_count (histograms) or _total (counters)."""
        metric = BY_KEY[key]
        name = sanitize(metric.name(self.naming))
        suffix = _unit_suffix(metric)
        return name if not suffix or name.endswith("_" + suffix) else f"{name}_{suffix}"

    def series(self, key: str) -> str:
        """The series name of a counter or gauge."""
        metric = BY_KEY[key]
        assert metric.kind != "histogram", f"{key}: a histogram has _bucket, _sum and _count series"
        return self.base(key) + ("_total" if metric.kind == "counter" else "")

    def bucket(self, key: str) -> str:
        assert BY_KEY[key].kind == "histogram", key
        return self.base(key) + "_bucket"

    def count(self, key: str) -> str:
        assert BY_KEY[key].kind == "histogram", key
        return self.base(key) + "_count"

    @property
    def evictor_le(self) -> str:
        """The matcher of the bucket at the evictor threshold."""
        return le_matcher(self.evictor_threshold)

    def metric_part(self, key: str) -> str:
        """The metric part of a recording rule name: the base name without colons."""
        return sanitize(BY_KEY[key].name(self.naming)).replace(":", "_")


def le_matcher(bound: float) -> str:
    """The ``le`` matcher (after ``le``) of the bucket with upper bound ``bound``, as Prometheus 2.x and
    3.x store it: an integer bound is "4" from Go exporters, "4.0" from prometheus_client and 3.x."""
    return f'=~"{bound:g}|{bound:.1f}"' if bound == int(bound) else f'="{bound:g}"'


def _unit_suffix(metric: MetricDef) -> str:
    if metric.unit not in _UNIT_SUFFIX:
        raise ValueError(f"{metric.key}: no Prometheus suffix known for unit {metric.unit!r}")
    return _UNIT_SUFFIX[metric.unit]
