"""The Grafana dashboard of a naming profile, built with grafana-foundation-sdk (Grafana 11.6 build).

The same panels for every profile; the series and label names come from ``Profile``. Every
histogram target asks for exemplars, and a field named ``trace_id`` (an exemplar's) links to the
trace in Tempo. Datasource uids are read from the provisioning file, the one place they are set.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import yaml
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

from .paths import DATASOURCES
from .profiles import Profile, le_matcher


def datasource_uids() -> dict[str, str]:
    return {d["type"]: d["uid"] for d in yaml.safe_load(DATASOURCES.read_text())["datasources"]}


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str
    exemplar: bool = False


def render_dashboard(p: Profile) -> str:
    return json.dumps(_Builder(p).dashboard().build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"


class _Builder:
    """The panels of one profile's dashboard."""

    def __init__(self, p: Profile) -> None:
        self.p = p
        uids = datasource_uids()
        self.prometheus = dm.DataSourceRef(type_val="prometheus", uid=uids["prometheus"])
        self.tempo_uid = uids["tempo"]
        self.ids = itertools.count(1)
        self.by = p.by
        self.who = f"{{{{{p.model}}}}} / {{{{{p.engine}}}}}"

    # PromQL ---------------------------------------------------------------------------------------

    def sel(self, series: str, *matchers: str) -> str:
        """``series`` for the selected models and engines."""
        p = self.p
        selected = [*matchers, f'{p.model}=~"$model_name"', f'{p.engine}=~"$engine"']
        return series + "{" + ", ".join(selected) + "}"

    def tenant_sel(self, series: str, *matchers: str) -> str:
        """``series`` for the selected models, engines and tenants."""
        return self.sel(series, *matchers, f'{self.p.label("tenant")}=~"$tenant"')

    def rate(self, key: str, extra: str = "") -> str:
        by = f"{self.by}, {extra}" if extra else self.by
        return f"sum by ({by}) (rate({self.sel(self.p.series(key))}[$__rate_interval]))"

    def quantile(self, key: str, q: str) -> str:
        bucket = self.sel(self.p.bucket(key))
        return f"histogram_quantile({q}, sum by (le, {self.by}) (rate({bucket}[$__rate_interval])))"

    def quantiles(self, key: str) -> list[Target]:
        return [
            Target(self.quantile(key, q), f"p{q[2:].ljust(2, '0')} {self.who}", True) for q in ("0.5", "0.9", "0.99")
        ]

    def share(self, le: str) -> str:
        key = "request_num_preemptions"
        bucket = self.sel(self.p.bucket(key), f"le{le}")
        count = self.sel(self.p.count(key))
        return (
            f"1 - sum by ({self.by}) (rate({bucket}[$__rate_interval])) / "
            f"(sum by ({self.by}) (rate({count}[$__rate_interval])) > 0)"
        )

    # Panels ---------------------------------------------------------------------------------------

    def timeseries(
        self,
        title: str,
        description: str,
        targets: list[Target],
        *,
        unit: str,
        height: int = 8,
        width: int = 12,
        max_one: bool = False,
        stacked: bool = False,
        min_zero: bool = True,
    ) -> Any:

        panel = (
            timeseries.Panel()
            .title(title)
            .description(description)
            .datasource(self.prometheus)
            .height(height)
            .span(width)
            .unit(unit)
            .draw_style(common.GraphDrawStyle.LINE)
            .line_width(1)
            .fill_opacity(10)
            .show_points(common.VisibilityMode.NEVER)
            .span_nulls(False)
            .stacking(
                cb.StackingConfig().mode(common.StackingMode.NORMAL if stacked else common.StackingMode.NONE).group("A")
            )
            .legend(
                cb.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
                .calcs(["lastNotNull", "max"])
            )
            .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        )
        if min_zero:
            panel = panel.min(0)
        if max_one:
            panel = panel.max(1)
        return self._targets(panel, targets)

    def _targets(self, panel: Any, targets: list[Target], as_heatmap: bool = False) -> Any:
        for ref, t in zip("ABCDEFGH", targets):
            query = (
                prometheus.Dataquery()
                .datasource(self.prometheus)
                .ref_id(ref)
                .expr(t.expr)
                .legend_format(t.legend)
                .range()
                .exemplar(t.exemplar)
            )
            panel = panel.with_target(query.format(pm.PromQueryFormat.HEATMAP) if as_heatmap else query)
        if any(t.exemplar for t in targets):
            trace = {
                "title": "Trace in Tempo",
                "url": "",
                "internal": {
                    "datasourceUid": self.tempo_uid,
                    "datasourceName": "Tempo",
                    "query": {"queryType": "traceql", "query": "${__value.raw}"},
                },
            }
            panel = panel.override_by_name("trace_id", [dm.DynamicConfigValue(id_val="links", value=[trace])])
        return panel

    def heatmap(self) -> Any:
        name = self.p.base("request_num_preemptions")
        panel = (
            heatmap.Panel()
            .title("Preemptions per finished request (distribution)")
            .description(
                f"Finished requests per bucket of {name} in each interval. The lowest row (le 0.5) holds the "
                "requests never preempted; rows above 4 are thrashing requests (preempted 5+ times)."
            )
            .datasource(self.prometheus)
            .height(9)
            .span(12)
            .calculate(False)
            .cell_gap(1)
            .y_axis(
                heatmap.YAxisConfig()
                .axis_placement(common.AxisPlacement.LEFT)
                .unit("short")
                .axis_label("preemptions (bucket upper bound)")
            )
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
            .color(
                heatmap.HeatmapColorOptions()
                .mode(hm.HeatmapColorMode.SCHEME)
                .scheme("Oranges")
                .steps(64)
                .exponent(0.5)
                .fill("dark-orange")
                .reverse(False)
            )
            .filter_values(heatmap.FilterValueRange().le(1e-9))
            .show_value(common.VisibilityMode.NEVER)
            .mode(common.TooltipDisplayMode.SINGLE)
            .show_y_histogram()
            .show_legend()
            .exemplars_color("rgba(255,0,255,0.7)")
        )
        bucket = self.sel(self.p.bucket("request_num_preemptions"))
        target = Target(f"sum by (le) (increase({bucket}[$__rate_interval]))", "{{le}}", True)
        return self._targets(panel, [target], as_heatmap=True)

    def dashboard(self) -> Any:
        p = self.p
        b = (
            dashboard.Dashboard("otel-llm: preemptions and latency" + ("" if p.naming == "vllm" else f" ({p.naming})"))
            .uid("otel-llm-preemptions" + ("" if p.naming == "vllm" else f"-{p.naming}"))
            .description(
                "Per-request preemptions, scheduler pressure and latency of LLM serving engines instrumented "
                f"with otel-llm (naming profile {p.naming})."
            )
            .tags(["otel-llm", "llm", p.naming, "preemption"])
            .editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .time("now-1h", "now")
            .refresh("30s")
            .timezone("")
            .version(1)
            .annotation(
                dashboard.AnnotationQuery()
                .name("Annotations & Alerts")
                .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                .enable(True)
                .hide(True)
                .icon_color("rgba(0, 211, 255, 1)")
                .type("dashboard")
                .built_in(1)
            )
            .with_variable(self.variable("model_name", "model", p.model, ""))
            .with_variable(self.variable("engine", "engine", p.engine, f'{{{p.model}=~"$model_name"}}'))
            .with_variable(
                self.variable(
                    "tenant", "tenant", p.label("tenant"), f'{{{p.model}=~"$model_name", {p.engine}=~"$engine"}}'
                )
            )
        )
        rows = (
            ("Preemptions per request", self._preemption_panels()),
            ("Tenants (with OTEL_LLM_TENANT)", self._tenant_panels()),
            ("Scheduler", self._scheduler_panels()),
            ("Latency", self._latency_panels()),
            ("Throughput and telemetry health", self._throughput_panels()),
        )
        for title, panels in rows:
            b = b.with_row(dashboard.Row(title).id(next(self.ids)))
            for panel in panels:
                b = b.with_panel(panel.id(next(self.ids)))
        return b

    def _preemption_panels(self) -> list[Any]:
        """The panels of the row "Preemptions per request"."""
        p, who = self.p, self.who
        reason = p.extra_label("num_preemptions_by_reason")
        panels: list[Any] = []
        panels.append(self.heatmap())
        panels.append(
            self.timeseries(
                "Preemptions per request: p50 / p90 / p99",
                "Per-request preemption count quantiles over finished requests (histogram_quantile over the "
                "buckets). Values at or below 0.5 mean not preempted. Exemplar dots link to the trace of a "
                "request in that bucket.",
                self.quantiles("request_num_preemptions"),
                unit="short",
                height=9,
                min_zero=False,
            )
        )
        panels.append(
            self.timeseries(
                "Share of finished requests preempted",
                "Preempted at least once = 1 - bucket{le=0.5}/count; thrashing (preempted 5+ times) = 1 - "
                "bucket{le=4}/count. Alert LLMPreemptionThrashing fires above 5% for 10 minutes.",
                [
                    Target(self.share(le_matcher(0.5)), f"preempted ≥1× {who}"),
                    Target(self.share(le_matcher(4)), f"thrashing ≥5× {who}"),
                ],
                unit="percentunit",
                max_one=True,
            )
        )
        panels.append(
            self.timeseries(
                "Preemptions by reason",
                "Preemptions per second, by reason (e.g. kv_cache_full).",
                [
                    Target(self.rate("num_preemptions_by_reason", reason), f"{{{{{reason}}}}} {who}"),
                    Target(self.rate("num_preemptions"), f"all reasons {who}"),
                ],
                unit="ops",
            )
        )
        panels.append(
            self.timeseries(
                "Recomputed tokens",
                "Tokens thrown away by preemption and computed again, per second, next to the prompt and "
                "generated tokens per second.",
                [
                    Target(self.rate("num_recomputed_tokens"), f"recomputed {who}"),
                    Target(self.rate("prompt_tokens"), f"prompt {who}"),
                    Target(self.rate("generation_tokens"), f"generated {who}"),
                ],
                unit="short",
            )
        )
        panels += self._evictor_panels()
        panels.append(
            self.timeseries(
                "Time spent preempted per request: p50 / p90 / p99",
                "Seconds a request spent between a preemption and its resumption "
                f"({p.base('request_preempted_time_seconds')}).",
                self.quantiles("request_preempted_time_seconds"),
                unit="s",
            )
        )
        return panels

    def _evictor_panels(self) -> list[Any]:
        """Who evicts: the preemptions each finished request caused, and preemptions by cause."""
        p, who = self.p, self.who
        key = "request_num_preemptions_caused"
        cause = p.extra_label("num_preemptions_by_cause")
        threshold = f"{p.evictor_threshold:g}"
        count, above = self.sel(p.count(key)), self.sel(p.bucket(key), f"le{p.evictor_le}")
        evictors = (
            f"sum by ({self.by}) (rate({count}[$__rate_interval])) - "
            f"sum by ({self.by}) (rate({above}[$__rate_interval]))"
        )
        return [
            self.timeseries(
                "Who evicts: preemptions caused per request, p50 / p90 / p99",
                f"Preemptions (of other requests or itself) that a finished request's KV demand caused "
                f"({p.base(key)}), and the requests per second that caused more than {threshold} (alert "
                "LLMRequestCausedManyPreemptions). Exemplar dots link to an evictor's trace; its victims' spans "
                "link to it.",
                [*self.quantiles(key), Target(evictors, f"caused >{threshold}/s {who}", True)],
                unit="short",
                min_zero=False,
            ),
            self.timeseries(
                "Preemptions by cause",
                "Preemptions per second by cause kind: request (another request's KV demand), self (its own), "
                "cache_reset, unknown (the engine cannot say). Counted when the preempted request finishes.",
                [Target(self.rate("num_preemptions_by_cause", cause), f"{{{{{cause}}}}} {who}")],
                unit="ops",
                stacked=True,
            ),
        ]

    def _tenant_panels(self) -> list[Any]:
        """Who suffers and who causes it, by tenant: series that exist only with a tenant source."""
        p, who = self.p, self.who
        tenant, cause = p.label("tenant"), p.label("cause_tenant")
        matrix = self.tenant_sel(p.series("num_preemptions_by_tenant"))
        by_tenant = f"{self.by}, {tenant}"

        def quantile(key: str) -> str:
            bucket = self.tenant_sel(p.bucket(key))
            return f"histogram_quantile(0.9, sum by (le, {by_tenant}) (rate({bucket}[$__rate_interval])))"

        tenant_legend = f"{{{{{tenant}}}}} {who}"

        def rate(by: str) -> str:
            return f"sum by ({by}) (rate({matrix}[$__rate_interval]))"

        panels = [
            self.timeseries(
                "Preemptions per request by tenant: p90",
                f"p90 of {p.base('request_num_preemptions')} per tenant (values at or below 0.5: not preempted). "
                "Exemplar dots link to a victim's trace; its links lead to the evictors and their tenants.",
                [Target(quantile("request_num_preemptions"), tenant_legend, True)],
                unit="short",
                min_zero=False,
            ),
            self.timeseries(
                "Preemptions suffered and caused by tenant",
                f"Preemptions per second of each tenant's requests (suffered), and those its requests' KV demand "
                f"caused (caused, by {cause}; none: a cache reset or an unknown cause).",
                [
                    Target(rate(by_tenant), f"suffered {tenant_legend}"),
                    Target(rate(f"{self.by}, {cause}"), f"caused {{{{{cause}}}}} {who}"),
                ],
                unit="ops",
            ),
            self.noisy_neighbours(matrix),
            self.timeseries(
                "Noisy neighbours: share of a tenant's preemptions caused by another",
                "For each victim tenant, the share of its preemptions that each other tenant's requests caused "
                "(alert LLMTenantCausesMostPreemptionsOfAnother above 0.5 for 10 minutes).",
                [
                    Target(
                        f"{rate(f'{by_tenant}, {cause}')} / on({by_tenant}) group_left() ({rate(by_tenant)} > 0)",
                        f"{{{{{cause}}}}} → {{{{{tenant}}}}} {who}",
                    )
                ],
                unit="percentunit",
                max_one=True,
            ),
        ]
        for key, title in (
            ("time_to_first_token_seconds", "Time to first token"),
            ("e2e_request_latency_seconds", "End-to-end latency"),
        ):
            panels.append(
                self.timeseries(
                    f"{title} by tenant: p90",
                    f"p90 of {p.base(key)} per tenant. Exemplars link to request traces.",
                    [Target(quantile(key), tenant_legend, True)],
                    unit="s",
                    width=8,
                )
            )
        panels.append(
            self.timeseries(
                "Tokens by tenant",
                "Prompt and generated tokens per second by tenant, and the tokens of requests that were then "
                f"aborted ({p.series('aborted_generation_tokens')}).",
                [
                    Target(
                        f"sum by ({by_tenant}) (rate({self.tenant_sel(p.series(key))}[$__rate_interval]))",
                        f"{name} {tenant_legend}",
                    )
                    for key, name in (
                        ("prompt_tokens", "prompt"),
                        ("generation_tokens", "generated"),
                        ("aborted_generation_tokens", "aborted"),
                    )
                ],
                unit="short",
                width=8,
            )
        )
        return panels

    def noisy_neighbours(self, matrix: str) -> Any:
        """The tenant matrix over the dashboard's time range as a table: a row per victim tenant, a
        column per cause tenant."""
        tenant, cause = self.p.label("tenant"), self.p.label("cause_tenant")
        query = (
            prometheus.Dataquery()
            .datasource(self.prometheus)
            .ref_id("A")
            .expr(f"sum by ({tenant}, {cause}) (increase({matrix}[$__range]))")
            .legend_format("")
            .instant()
            .format(pm.PromQueryFormat.TABLE)
        )
        grouping = dm.DataTransformerConfig(
            id_val="groupingToMatrix",
            options={"columnField": cause, "rowField": tenant, "valueField": "Value", "emptyValue": "zero"},
        )
        return (
            table.Panel()
            .title("Noisy neighbours: who hurt whom")
            .description(
                f"Preemptions over the time range: a row per victim tenant ({tenant}), a column per tenant whose "
                f"requests' KV demand caused them ({cause}; none: a cache reset or an unknown cause). The diagonal "
                "is a tenant preempting its own requests."
            )
            .datasource(self.prometheus)
            .height(8)
            .span(12)
            .unit("short")
            .decimals(0)
            .with_target(query)
            .with_transformation(grouping)
        )

    def _scheduler_panels(self) -> list[Any]:
        """The panels of the row "Scheduler"."""
        p, who = self.p, self.who
        panels: list[Any] = []
        gauge = "sum by ({by}) ({series})"
        panels.append(
            self.timeseries(
                "Running and waiting requests",
                "Requests in the running batch and in the waiting queue (including preempted ones).",
                [
                    Target(
                        gauge.format(by=self.by, series=self.sel(p.series("num_requests_running"))),
                        f"running {who}",
                    ),
                    Target(
                        gauge.format(by=self.by, series=self.sel(p.series("num_requests_waiting"))),
                        f"waiting {who}",
                    ),
                ],
                unit="short",
            )
        )
        panels.append(
            self.timeseries(
                "KV cache usage",
                "Fraction of KV cache blocks in use (0..1). Preemptions start when it reaches 1.",
                # The processes of one engine report the same cache: the largest, not their sum.
                [Target(f"max by ({self.by}) ({self.sel(p.series('kv_cache_usage_perc'))})", who)],
                unit="percentunit",
                max_one=True,
            )
        )
        return panels

    def _latency_panels(self) -> list[Any]:
        """The panels of the row "Latency"."""
        p, who = self.p, self.who
        panels: list[Any] = []
        for key, title in (
            ("time_to_first_token_seconds", "Time to first token"),
            ("inter_token_latency_seconds", "Inter-token latency"),
            ("e2e_request_latency_seconds", "End-to-end request latency"),
        ):
            panels.append(
                self.timeseries(
                    f"{title}: p50 / p90 / p99",
                    f"{p.base(key)}. Exemplars link to request traces.",
                    self.quantiles(key),
                    unit="s",
                    width=8,
                )
            )
        phases = ("queue", "prefill", "decode", "inference")
        panels.append(
            self.timeseries(
                "Request phases: p90",
                "p90 of the time requests spend queued, in prefill, in decode, and in inference (prefill + decode).",
                [Target(self.quantile(f"request_{ph}_time_seconds", "0.9"), f"{ph} {who}", True) for ph in phases],
                unit="s",
            )
        )
        tpot = "request_time_per_output_token_seconds"
        panels.append(
            self.timeseries(
                "Time per output token: p50 / p90 / p99",
                f"{p.base(tpot)} (decode time / generated tokens, per request).",
                self.quantiles(tpot),
                unit="s",
            )
        )
        return panels

    def _throughput_panels(self) -> list[Any]:
        """The panels of the row "Throughput and telemetry health"."""
        p, who = self.p, self.who
        finish, drop_reason = p.extra_label("request_success"), p.extra_label("dropped_events")
        panels: list[Any] = []
        panels.append(
            self.timeseries(
                "Finished requests by reason",
                f"Finished requests per second by {finish} (stop, length, abort, error).",
                [Target(self.rate("request_success", finish), f"{{{{{finish}}}}} {who}")],
                unit="reqps",
                width=8,
                stacked=True,
            )
        )
        tokens = (
            ("request_prompt_tokens", "prompt"),
            ("request_generation_tokens", "generated"),
            ("request_params_max_tokens", "max_tokens"),
            ("iteration_tokens_total", "per step"),
        )
        panels.append(
            self.timeseries(
                "Tokens per request: p90",
                "p90 of prompt tokens, generated tokens and requested max_tokens per request, and of tokens per "
                "engine step.",
                [Target(self.quantile(key, "0.9"), f"{name} {who}", True) for key, name in tokens],
                unit="short",
                width=8,
            )
        )
        drops = self.sel(p.series("dropped_events"))
        panels.append(
            self.timeseries(
                "Dropped telemetry events",
                "Events the plugin could not apply and dropped, by reason (alert OtelLLMTelemetryDroppingEvents). "
                "Empty means none was ever dropped.",
                [
                    Target(
                        f"sum by ({self.by}, {drop_reason}) (increase({drops}[$__rate_interval]))",
                        f"{{{{{drop_reason}}}}} {who}",
                    )
                ],
                unit="short",
                width=8,
            )
        )
        return panels

    def variable(self, name: str, label: str, label_name: str, matchers: str) -> Any:
        query = f"label_values({self.p.count('request_num_preemptions')}{matchers}, {label_name})"
        return (
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(self.prometheus)
            .query({"query": query, "refId": f"PrometheusVariableQueryEditor-{name}", "qryType": 1})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
