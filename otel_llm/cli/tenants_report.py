"""The demo's tenant view (``otel-llm demo --tenants N``): each tenant's preemption histogram and
the tenant matrix (who hurt whom, in counts and shares of the victim tenant's preemptions), read
from the telemetry and checked against the engine's own record of who evicted whom."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from otel_llm.catalogue.metrics import BY_KEY, label_key
from otel_llm.cli.render import PreemptionHistogram, bucket_labels
from otel_llm.config.settings import TelemetryConfig
from otel_llm.config.tenants import NO_CAUSE

Matrix = Mapping[tuple[str, str], int]  # (victim's tenant, cause's tenant) -> preemptions


@dataclass(frozen=True)
class TenantReport:
    histograms: dict[str, PreemptionHistogram]  # tenant -> its request_num_preemptions
    matrix: dict[tuple[str, str], int]
    histogram_name: str
    matrix_name: str

    @classmethod
    def from_metrics(cls, data: Any, config: TelemetryConfig) -> "TenantReport":
        """From one collection of a metric reader (``MetricsData``)."""
        tenant, cause = label_key(config, "tenant"), label_key(config, "cause_tenant")
        histogram_name = BY_KEY["request_num_preemptions"].name(config.naming)
        matrix_name = BY_KEY["num_preemptions_by_tenant"].name(config.naming)
        histograms = {
            str(p.attributes[tenant]): PreemptionHistogram.from_point(p)
            for p in _points(data, histogram_name)
            if tenant in p.attributes
        }
        matrix = {
            (str(p.attributes[tenant]), str(p.attributes[cause])): int(p.value) for p in _points(data, matrix_name)
        }
        return cls(histograms, matrix, histogram_name, matrix_name)


def _points(data: Any, name: str) -> Iterable[Any]:
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    yield from metric.data.data_points


def summed_histogram(data: Any, name: str) -> PreemptionHistogram:
    """``name``'s histogram in one collection (``MetricsData``), summed over its series (one per
    tenant with a tenant source, else one)."""
    parts = [PreemptionHistogram.from_point(p) for p in _points(data, name)]
    if not parts:
        raise RuntimeError(f"no {name} series")
    counts = [sum(column) for column in zip(*(h.counts for h in parts))]
    return PreemptionHistogram(parts[0].bounds, counts, sum(h.count for h in parts), sum(h.sum for h in parts))


def engine_matrix(outputs: Iterable[Any], tenant_of: Mapping[str, str]) -> Counter[tuple[str, str]]:
    """The matrix from the engine's record (each output's ``preempted_by``: the cause of each of
    its preemptions) and each request's tenant."""
    return Counter(
        (tenant_of[o.request_id], tenant_of.get(cause, NO_CAUSE)) for o in outputs for cause in o.preempted_by
    )


def print_tenants(report: TenantReport, truth: Matrix) -> None:
    tenants = sorted(report.histograms, key=_order)
    some = next(iter(report.histograms.values()), None)
    labels = bucket_labels(some.bounds) if some is not None else []
    print(f"per tenant ({report.histogram_name}{{tenant}}): requests per preemption count")
    width = max([len("tenant"), *map(len, tenants)])
    print(f"  {'tenant':<{width}}  requests  preemptions  " + " ".join(f"{label:>5}" for label in labels))
    for t in tenants:
        h = report.histograms[t]
        counts = " ".join(f"{c:5d}" for c in h.counts)
        print(f"  {t:<{width}}  {h.count:8d}  {int(h.sum):11d}  {counts}")
    print()
    print_matrix(report.matrix, report.matrix_name)
    agrees = {k: v for k, v in report.matrix.items() if v} == {k: v for k, v in truth.items() if v}
    print(f"  {'the telemetry equals the engine record' if agrees else 'MISMATCH with the engine record'}")


def print_matrix(matrix: Matrix, name: str) -> None:
    """Rows: the victims' tenants; columns: the causes' tenants; each cell the preemptions and
    their share of the row (the victim tenant's preemptions)."""
    victims = sorted({v for v, _ in matrix}, key=_order)
    causes = sorted({c for _, c in matrix}, key=_order)
    print(f"who hurt whom ({name}): rows the victims' tenant, columns the cause's, share of the row")
    if not matrix:
        print("  no preemption")
        return
    width = max([len("victim"), *map(len, victims)])
    cell = 12
    print(f"  {'victim':<{width}}  " + "".join(f"{c:>{cell}}" for c in causes) + f"{'total':>{cell}}")
    for v in victims:
        total = sum(matrix.get((v, c), 0) for c in causes)
        cells = "".join(f"{_cell(matrix.get((v, c), 0), total):>{cell}}" for c in causes)
        print(f"  {v:<{width}}  {cells}{total:>{cell}}")
    worst = max(((n, v, c) for (v, c), n in matrix.items() if v != c and c != NO_CAUSE), default=None)
    if worst is not None:
        n, v, c = worst
        print(f"  most across tenants: {c} caused {n} preemptions of {v}")


def _cell(n: int, total: int) -> str:
    return f"{n} ({100 * n / total:.0f}%)" if total else "0"


def _order(tenant: str) -> tuple[int, Any]:
    """Numbers (priorities) in numeric order, then names."""
    return (0, int(tenant)) if tenant.lstrip("-").isdigit() else (1, tenant)


def print_tenant_view(config: TelemetryConfig, requests: Iterable[Any], outputs: Iterable[Any], reader: Any) -> None:
    """The demo's tenant section: ``requests`` the workload's (their ``priority`` and ``lora``),
    ``outputs`` the engine's, ``reader`` the demo's in-memory metric reader."""
    source = config.tenant_source
    if source is None:
        print("tenants: no tenant source in effect (see the warning above)")
        return
    report = TenantReport.from_metrics(reader.get_metrics_data(), config)
    if source.kind == "priority":
        tenant_of = {r.request_id: str(r.priority) for r in requests}
    elif source.kind == "lora":
        tenant_of = {r.request_id: r.lora or config.model_name for r in requests}
    else:  # the workload carries no other source: the same tenant for every request
        tenant_of = {r.request_id: config.model_name if source.kind == "model" else "unset" for r in requests}
    print(f"tenants (OTEL_LLM_TENANT={source})")
    print_tenants(report, engine_matrix(outputs, tenant_of))
    print(flush=True)
