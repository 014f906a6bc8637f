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

PROFILES = ("vllm", "semconv")

# Unit -> Prometheus name suffix, for the units the table uses ({...} annotations add none). A unit
# missing here stops the generator: its suffix must be looked up, not guessed.
_UNIT_SUFFIX = {"s": "seconds", "": "", "{preemption}": "", "{token}": "", "{request}": "", "{event}": ""}


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_:]", "_", name)


@dataclass(frozen=True)
class Profile:
    naming: str

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

    def metric_part(self, key: str) -> str:
        """The metric part of a recording rule name: the base name without colons."""
        return sanitize(BY_KEY[key].name(self.naming)).replace(":", "_")


def _unit_suffix(metric: MetricDef) -> str:
    if metric.unit not in _UNIT_SUFFIX:
        raise ValueError(f"{metric.key}: no Prometheus suffix known for unit {metric.unit!r}")
    return _UNIT_SUFFIX[metric.unit]
