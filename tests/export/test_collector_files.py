"""The operator-facing files in collector/: valid for the tools that read them, consistent with each other,
and, for the dashboards and rules of both naming profiles, equal to what collector/generate makes.

The OpenTelemetry Collector, Tempo, Grafana and Docker cannot run here, so their files are checked by
structure and by cross-references (ports, uids, mounts). Prometheus' files are checked by promtool
itself: `check rules`, `test rules` (the unit tests in collector/rules/) and `check config`.
promtool missing skips those tests, or fails them under OTEL_LLM_REQUIRE_BACKENDS=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from collector.generate import generated_files, paths
from collector.generate import sdk as generator_sdk
from collector.generate.profiles import PROFILES, Profile
from tests.support import promql as expressions

ROOT = Path(__file__).resolve().parents[2]
COLLECTOR = ROOT / "collector"
RULES = {p: COLLECTOR / "rules" / paths.rules_file(Profile(p)) for p in PROFILES}
RULES_TEST = {p: COLLECTOR / "rules" / paths.rule_tests_file(Profile(p)) for p in PROFILES}
PROMETHEUS_YML = COLLECTOR / "prometheus.yml"
OTELCOL = COLLECTOR / "otel-collector.yaml"
AGENT = COLLECTOR / "otel-collector-agent.yaml"  # a fleet: one per host
GATEWAY = COLLECTOR / "otel-collector-gateway.yaml"  # a fleet: the agents' destination
TEMPO = COLLECTOR / "tempo.yaml"
COMPOSE = COLLECTOR / "docker-compose.yaml"
DASHBOARD = {p: expressions.dashboard_path(p) for p in PROFILES}
DATASOURCES = COLLECTOR / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
DASH_PROVIDERS = COLLECTOR / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------------------------------------
# promtool


def _require_backends() -> bool:
    return os.environ.get("OTEL_LLM_REQUIRE_BACKENDS", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found (Debian package prometheus)"
        if _require_backends():
            pytest.fail(message + " and OTEL_LLM_REQUIRE_BACKENDS=1", pytrace=False)
        pytest.skip(message)
    return path


def run_promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.backend
@pytest.mark.parametrize("profile", PROFILES)
def test_promtool_check_rules(promtool, profile):
    proc = run_promtool(promtool, "check", "rules", str(RULES[profile]))
    n_rules = sum(len(g["rules"]) for g in load_yaml(RULES[profile])["groups"])
    assert f"SUCCESS: {n_rules} rules found" in proc.stdout


@pytest.mark.backend
@pytest.mark.parametrize("profile", PROFILES)
def test_promtool_unit_tests_pass(promtool, profile):
    # Run from elsewhere: rule_files in the test file resolve relative to the test file.
    proc = run_promtool(promtool, "test", "rules", str(RULES_TEST[profile]), cwd=ROOT)
    assert "SUCCESS" in proc.stdout and "FAILED" not in proc.stdout


@pytest.mark.backend
def test_promtool_check_config_resolves_rules_relative_to_the_config(promtool, tmp_path):
    proc = run_promtool(promtool, "check", "config", str(PROMETHEUS_YML), cwd=tmp_path)
    assert "SUCCESS" in proc.stdout
    for path in RULES.values():  # every rule file was found and checked too
        assert f"rules/{path.name}" in proc.stdout


@pytest.mark.backend
@pytest.mark.parametrize("profile", PROFILES)
def test_every_shipped_expression_parses(promtool, tmp_path, profile):
    """Each dashboard/rule expression, variables substituted, compiled by promtool as a recording rule."""
    exprs = expressions.all_expressions("tiny", "engine_stub", profile=profile)
    rules = {
        "groups": [
            {
                "name": "parse-check",
                "rules": [{"record": f"parse_check_{i}", "expr": expr} for i, (_, expr) in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "parse.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    run_promtool(promtool, "check", "rules", str(path))


# --------------------------------------------------------------------------------------------------
# Rules and their unit tests


def _rules(profile: str = "vllm"):
    return [r for g in load_yaml(RULES[profile])["groups"] for r in g["rules"]]


@pytest.mark.parametrize("profile", PROFILES)
def test_recording_rule_names_follow_level_metric_operation(profile):
    for rule in _rules(profile):
        if "record" not in rule:
            continue
        parts = rule["record"].split(":")
        assert len(parts) == 3 and all(parts), f"{rule['record']}: want level:metric:operation"
        level, metric, operation = parts
        # The level names the labels the rule aggregates to.
        by = re.search(r"by \(([^)]*)\)", rule["expr"])
        assert by, rule["record"]
        kept = [label.strip() for label in by.group(1).split(",") if label.strip() != "le"]
        kept += sorted((rule.get("labels") or {}).keys())
        assert level == "_".join(kept), f"{rule['record']}: level {level!r} but aggregates to {kept}"


# The recorded names of each profile, written out: what an operator's queries and alerts refer to.
SHARES = {
    "vllm": "model_name_engine:vllm_request_num_preemptions:{}_ratio_rate5m",
    "semconv": "gen_ai_request_model_llm_engine:llm_server_request_num_preemptions:{}_ratio_rate5m",
}


@pytest.mark.parametrize("profile", PROFILES)
def test_rules_use_the_shipped_thresholds_and_windows(profile):
    by_name = {r.get("alert") or r.get("record"): r for r in _rules(profile)}
    thrash = by_name["LLMPreemptionThrashing"]
    assert thrash["for"] == "10m" and thrash["expr"] == SHARES[profile].format("thrashing") + " > 0.05"
    assert 'le=~"4|4.0"' in by_name[SHARES[profile].format("thrashing")]["expr"]
    assert 'le="0.5"' in by_name[SHARES[profile].format("preempted")]["expr"]
    spike = by_name["LLMPreemptionRateSpike"]["expr"]
    assert "3 *" in spike and "offset 1h" in spike and "> 0.1" in spike
    quantiles = sorted(
        r["labels"]["quantile"] for r in _rules(profile) if r.get("record", "").endswith(":histogram_quantile5m")
    )
    assert quantiles == ["0.5", "0.9", "0.99"]


def test_both_profiles_have_the_same_rules_under_their_own_names():
    vllm, semconv = _rules("vllm"), _rules("semconv")
    assert [r.get("alert") for r in vllm] == [r.get("alert") for r in semconv]
    assert [r.get("labels") for r in vllm] == [r.get("labels") for r in semconv]
    text = RULES["semconv"].read_text() + RULES_TEST["semconv"].read_text()
    assert not re.findall(r"vllm:\w+|\bmodel_name\b", text), "vllm profile names in the semconv rules"


@pytest.mark.parametrize("profile", PROFILES)
def test_unit_tests_cover_every_rule_firing_and_not_firing(profile):
    tests = load_yaml(RULES_TEST[profile])["tests"]
    exprs_tested = " ".join(t["expr"] for test in tests for t in test.get("promql_expr_test", []))
    alert_cases = [a for test in tests for a in test.get("alert_rule_test", [])]
    for rule in _rules(profile):
        if "record" in rule:
            assert rule["record"] in exprs_tested, f"recording rule {rule['record']} has no promql_expr_test"
            continue
        cases = [c for c in alert_cases if c["alertname"] == rule["alert"]]
        assert any(c.get("exp_alerts") for c in cases), f"{rule['alert']}: no firing case"
        assert any(not c.get("exp_alerts") for c in cases), f"{rule['alert']}: no not-firing case"
    # Expected sample values are exact numbers, not left out.
    for test in tests:
        for t in test.get("promql_expr_test", []):
            for sample in t["exp_samples"]:
                assert isinstance(sample["value"], (int, float)), sample


# --------------------------------------------------------------------------------------------------
# Expressions: metric names, the expressions module


@pytest.mark.parametrize("profile", PROFILES)
def test_all_expressions_lists_every_target_variable_and_rule(profile):
    dash = json.loads(DASHBOARD[profile].read_text())
    n_targets = sum(len(p.get("targets", [])) for p in _all_panels(dash))
    n_vars = len(dash["templating"]["list"])
    n_rules = len(_rules(profile))
    exprs = expressions.all_expressions("tiny", "engine_stub", profile=profile)
    assert len(exprs) == n_targets + n_vars + n_rules
    assert len({where for where, _ in exprs}) == len(exprs), "where must name each expression uniquely"
    model, engine = LABELS[profile]
    for where, expr in exprs:
        # $1 and the like: label_replace's replacement, not a Grafana variable.
        assert not re.search(r"\$(?!\d)", expr), f"{where}: unsubstituted variable in {expr}"
        if where.startswith("dashboard panel"):
            assert f'{model}=~"tiny"' in expr and f'{engine}=~"engine_stub"' in expr, where


def test_referenced_series_finds_selectors_and_ranges_only():
    expr = 'sum by (le) (rate(a:b_bucket{le="0.5", m=~"x"}[1m])) / rate(c_total[5m]) > on() lvl:d:rate5m'
    assert expressions.referenced_series(expr) == {"a:b_bucket", "c_total"}


def test_all_expressions_substitutes_intervals_and_escapes_values():
    exprs = dict(expressions.all_expressions("meta-llama/Llama-3.1 (8B)", "vllm", rate_interval="30s"))
    heat = next(e for w, e in exprs.items() if "distribution" in w)
    assert "[30s]" in heat
    assert r'model_name=~"meta-llama/Llama-3\\.1 \\(8B\\)"' in heat
    assert expressions.substitute("x[$__interval] y[${__range}]", "m", "e", interval="7s", range_="2h") == "x[7s] y[2h]"
    with pytest.raises(KeyError):
        expressions.substitute("$nope", "m", "e")


# The model and engine labels of each profile, as Prometheus stores them (written out, not derived).
LABELS = {"vllm": ("model_name", "engine"), "semconv": ("gen_ai_request_model", "llm_engine")}
COUNT = {"vllm": "vllm:request_num_preemptions_count", "semconv": "llm_server_request_num_preemptions_count"}


@pytest.mark.parametrize("profile", PROFILES)
def test_variable_queries_become_promql(profile):
    exprs = dict(expressions.dashboard_expressions(profile))
    (model, engine), count = LABELS[profile], COUNT[profile]
    assert exprs["dashboard variable model_name"] == f"group by ({model}) ({count})"
    assert exprs["dashboard variable engine"] == f'group by ({engine}) ({count}{{{model}=~"$model_name"}})'


# --------------------------------------------------------------------------------------------------
# OpenTelemetry Collector


def _component_type(name: str) -> str:
    return name.split("/", 1)[0]


@pytest.mark.parametrize("path", [OTELCOL, AGENT, GATEWAY], ids=lambda p: p.name)
def test_collector_pipelines_reference_defined_components(path):
    cfg = load_yaml(path)
    service = cfg["service"]
    for ext in service.get("extensions", []):
        assert ext in cfg["extensions"], f"extension {ext} not defined"
    pipelines = service["pipelines"]
    assert set(pipelines) == {"metrics", "traces"}
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            assert pipeline[kind], f"{name}: no {kind}"
            for component in pipeline[kind]:
                assert component in (cfg.get(kind) or {}), f"{name}: {kind[:-1]} {component} not defined"
        assert pipeline["processors"][0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert "batch" in pipeline["processors"]
    # Nothing defined but unused (an unused exporter would be a silent misconfiguration).
    for kind in ("receivers", "processors", "exporters"):
        used = {c for p in pipelines.values() for c in p[kind]}
        assert set(cfg[kind]) == used, f"{kind} defined but unused: {set(cfg[kind]) - used}"


def test_fleet_agent_listens_on_loopback_and_queues_for_the_gateway():
    cfg = load_yaml(AGENT)
    for protocol in cfg["receivers"]["otlp"]["protocols"].values():
        assert protocol["endpoint"].startswith("127.0.0.1:"), "engine processes are on the agent's host"
    (exporter,) = cfg["exporters"].values()
    assert exporter["sending_queue"]["enabled"] and exporter["sending_queue"]["queue_size"] > 0
    assert exporter["retry_on_failure"]["enabled"]
    for pipeline in cfg["service"]["pipelines"].values():
        assert pipeline["exporters"] == list(cfg["exporters"]), "everything goes to the gateway"


def test_fleet_gateway_makes_delta_cumulative_and_keeps_processes_apart():
    cfg = load_yaml(GATEWAY)
    metrics = cfg["service"]["pipelines"]["metrics"]
    processors = metrics["processors"]
    assert processors.index("deltatocumulative") < processors.index("batch")
    prom = cfg["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True and "namespace" not in prom
    # job/instance from service.name/service.instance.id: per-process series; resources not copied onto them.
    assert prom["resource_to_telemetry_conversion"]["enabled"] is False
    assert metrics["exporters"] == ["prometheus"]


def test_collector_receives_otlp_and_exports_openmetrics_and_traces():
    cfg = load_yaml(OTELCOL)
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    limiter = cfg["processors"]["memory_limiter"]
    assert limiter["check_interval"] and (limiter.get("limit_mib") or limiter.get("limit_percentage"))
    prom = cfg["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True, "exemplars are only exposed in OpenMetrics"
    assert "namespace" not in prom, "a namespace would rename every vllm: series"
    pipelines = cfg["service"]["pipelines"]
    assert "prometheus" in pipelines["metrics"]["exporters"]
    trace_exporters = pipelines["traces"]["exporters"]
    assert [e for e in trace_exporters if _component_type(e) == "otlp"], "traces must go out over OTLP"


def test_collector_trace_exporter_points_at_tempo_otlp_receiver():
    tempo_grpc = load_yaml(TEMPO)["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    tempo_port = tempo_grpc.rsplit(":", 1)[1]
    exporter = load_yaml(OTELCOL)["exporters"]["otlp/tempo"]
    host, port = exporter["endpoint"].rsplit(":", 1)
    assert host == "tempo" and port == tempo_port
    assert "tempo" in load_yaml(COMPOSE)["services"]


# --------------------------------------------------------------------------------------------------
# Tempo and Prometheus config


def test_tempo_config_is_single_binary_local_with_otlp():
    cfg = load_yaml(TEMPO)
    protocols = cfg["distributor"]["receivers"]["otlp"]["protocols"]
    assert set(protocols) == {"grpc", "http"}
    trace = cfg["storage"]["trace"]
    assert trace["backend"] == "local" and trace["local"]["path"] and trace["wal"]["path"]
    assert isinstance(cfg["server"]["http_listen_port"], int)
    # Both storage paths live on the volume docker-compose mounts for Tempo.
    mounts = [v.split(":")[1] for v in load_yaml(COMPOSE)["services"]["tempo"]["volumes"]]
    for path in (trace["local"]["path"], trace["wal"]["path"]):
        assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), path


def test_prometheus_scrapes_the_collector_and_the_plugin():
    cfg = load_yaml(PROMETHEUS_YML)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    collector_port = load_yaml(OTELCOL)["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    collector_targets = [t for sc in jobs["otel-collector"]["static_configs"] for t in sc["targets"]]
    assert collector_targets == [f"otel-collector:{collector_port}"]
    assert jobs["otel-collector"]["honor_labels"] is True
    plugin_targets = [t for sc in jobs["otel-llm"]["static_configs"] for t in sc["targets"]]
    assert [t.rsplit(":", 1)[1] for t in plugin_targets] == ["9464"]  # the plugin's default port
    assert cfg["rule_files"] == [f"rules/{RULES[p].name}" for p in PROFILES]
    assert all((PROMETHEUS_YML.parent / path).is_file() for path in cfg["rule_files"])


# --------------------------------------------------------------------------------------------------
# Grafana


def _all_panels(dash):
    out = []

    def walk(panels):
        for p in panels:
            out.append(p)
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def _datasources():
    return load_yaml(DATASOURCES)["datasources"]


def test_datasources_link_exemplars_to_tempo():
    sources = _datasources()
    uids = [d["uid"] for d in sources]
    assert len(uids) == len(set(uids))
    by_type = {d["type"]: d for d in sources}
    tempo, prom = by_type["tempo"], by_type["prometheus"]
    links = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert [(link["name"], link["datasourceUid"]) for link in links] == [("trace_id", tempo["uid"])]
    # Grafana expands $ in provisioning files: literal ${...} must be written $${...}.
    for link in links:
        for value in link.values():
            assert not re.search(r"(?<!\$)\$\{", str(value)), value
    tempo_port = load_yaml(TEMPO)["server"]["http_listen_port"]
    assert tempo["url"] == f"http://tempo:{tempo_port}"
    assert prom["url"] == "http://prometheus:9090"


def test_dashboard_provider_path_is_where_compose_mounts_the_dashboards():
    providers = load_yaml(DASH_PROVIDERS)["providers"]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    grafana_volumes = load_yaml(COMPOSE)["services"]["grafana"]["volumes"]
    mounts = dict(reversed(v.split(":")[:2]) for v in grafana_volumes)
    assert Path(mounts[providers[0]["options"]["path"]]) == Path("./grafana/dashboards")
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


@pytest.mark.parametrize("profile", PROFILES)
def test_dashboard_queries_use_the_variables_everywhere(profile):
    dash = json.loads(DASHBOARD[profile].read_text())
    model, engine = LABELS[profile]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["model_name", "engine", "tenant"]
    for var in dash["templating"]["list"]:
        assert var["type"] == "query" and var["query"]["query"].startswith("label_values(")
    targets = [(p, t) for p in _all_panels(dash) for t in p.get("targets", [])]
    assert targets
    for panel, target in targets:
        expr = target["expr"]
        assert "$model_name" in expr and "$engine" in expr, f"panel {panel['title']!r}: {expr}"
        # Every selector of a metric carries both matchers (not just one of several).
        for series in expressions.referenced_series(expr):
            for m in re.finditer(re.escape(series) + r"(\{[^}]*\})?", expr):
                matchers = m.group(1) or ""
                assert f'{model}=~"$model_name"' in matchers and f'{engine}=~"$engine"' in matchers, (
                    f"panel {panel['title']!r}: selector {m.group(0)} lacks the variables"
                )


@pytest.mark.parametrize("profile", PROFILES)
def test_dashboard_histogram_panels_show_exemplars_linked_to_tempo(profile):
    dash = json.loads(DASHBOARD[profile].read_text())
    tempo = next(d["uid"] for d in _datasources() if d["type"] == "tempo")
    histogram_panels = [
        p
        for p in _all_panels(dash)
        if any("histogram_quantile" in t["expr"] or t.get("format") == "heatmap" for t in p.get("targets", []))
    ]
    assert len(histogram_panels) == 13
    for panel in histogram_panels:
        for target in panel["targets"]:
            assert target.get("exemplar") is True, f"panel {panel['title']!r} target {target['refId']}"
        # A trace id (the exemplar's trace_id label) links to the trace in Tempo.
        (override,) = [
            o for o in panel["fieldConfig"]["overrides"] if o["matcher"] == {"id": "byName", "options": "trace_id"}
        ]
        (links,) = [prop["value"] for prop in override["properties"] if prop["id"] == "links"]
        assert [(link["internal"]["datasourceUid"], link["internal"]["query"]["query"]) for link in links] == [
            (tempo, "${__value.raw}")
        ]


def test_both_dashboards_have_the_same_panels():
    vllm, semconv = (json.loads(DASHBOARD[p].read_text()) for p in PROFILES)

    def shape(dash):
        return [
            (
                p["id"],
                p["type"],
                p["title"],
                p["gridPos"],
                [(t["refId"], t.get("exemplar")) for t in p.get("targets", [])],
            )
            for p in _all_panels(dash)
        ]

    assert shape(vllm) == shape(semconv)
    assert vllm["uid"] != semconv["uid"] and vllm["title"] != semconv["title"]
    assert "vllm:" not in DASHBOARD["semconv"].read_text()
    assert not re.search(r"\bmodel_name=", DASHBOARD["semconv"].read_text())


def test_dashboard_has_the_required_panels():
    dash = json.loads(DASHBOARD["vllm"].read_text())
    panels = _all_panels(dash)
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    heatmaps = [p for p in panels if p["type"] == "heatmap"]
    assert any(
        t.get("format") == "heatmap" and "vllm:request_num_preemptions_bucket" in t["expr"]
        for p in heatmaps
        for t in p["targets"]
    )
    for needle in (
        "histogram_quantile(0.99, sum by (le, model_name, engine) (rate(vllm:request_num_preemptions_bucket",
        'vllm:request_num_preemptions_bucket{le="0.5"',
        'vllm:request_num_preemptions_bucket{le=~"4|4.0"',
        "vllm:num_preemptions_by_reason_total",
        "vllm:num_recomputed_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        'vllm:request_num_preemptions_bucket{tenant=~"$tenant"',
        "sum by (tenant, cause_tenant) (increase(vllm:num_preemptions_by_tenant_total{",
        'vllm:time_to_first_token_seconds_bucket{tenant=~"$tenant"',
    ):
        assert needle in exprs, needle
    (matrix,) = [p for p in panels if p["title"] == "Noisy neighbours: who hurt whom"]
    assert matrix["type"] == "table" and matrix["targets"][0]["instant"] is True
    assert matrix["transformations"] == [
        {
            "id": "groupingToMatrix",
            "options": {
                "columnField": "cause_tenant",
                "rowField": "tenant",
                "valueField": "Value",
                "emptyValue": "zero",
            },
        }
    ]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0


@pytest.mark.parametrize("profile", PROFILES)
def test_dashboard_datasource_uids_exist_in_provisioning(profile):
    uids = {d["uid"]: d["type"] for d in _datasources()}
    dash = json.loads(DASHBOARD[profile].read_text())
    refs = []

    def collect(node):
        if isinstance(node, dict):
            ds = node.get("datasource")
            if isinstance(ds, dict) and ds.get("type") != "grafana":
                refs.append(ds)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(dash)
    assert refs
    for ref in refs:
        assert ref["uid"] in uids and uids[ref["uid"]] == ref["type"], ref
    assert dash["uid"] and len(dash["uid"]) <= 40


# --------------------------------------------------------------------------------------------------
# docker-compose


def test_compose_mounts_point_at_files_that_exist():
    services = load_yaml(COMPOSE)["services"]
    assert {"otel-collector", "prometheus", "tempo", "grafana"} <= set(services)
    bind_mounts = 0
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                bind_mounts += 1
                assert (COMPOSE.parent / source).exists(), f"{name}: {source} does not exist"
    assert bind_mounts >= 6


def test_compose_commands_use_the_mounted_configs():
    services = load_yaml(COMPOSE)["services"]

    def mounted(service):
        return {v.split(":")[1]: v.split(":")[0] for v in services[service].get("volumes", [])}

    def config_arg(service, flag):
        for arg in services[service]["command"]:
            if arg.startswith(flag):
                return arg.split("=", 1)[1]
        raise AssertionError(f"{service}: no {flag}")

    assert mounted("otel-collector")[config_arg("otel-collector", "--config=")] == "./otel-collector.yaml"
    assert mounted("tempo")[config_arg("tempo", "-config.file=")] == "./tempo.yaml"
    prom_cfg = config_arg("prometheus", "--config.file=")
    assert mounted("prometheus")[prom_cfg] == "./prometheus.yml"
    # rule_files resolve relative to the config inside the container too.
    rules_dir = str(Path(prom_cfg).parent / "rules")
    assert mounted("prometheus")[rules_dir] == "./rules"
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    for image in (s["image"] for s in services.values()):
        assert ":" in image and not image.endswith(":latest"), f"unpinned image {image}"


def test_compose_publishes_ports_on_loopback_only():
    for name, service in load_yaml(COMPOSE)["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"
    published = {p.split(":")[1] for p in load_yaml(COMPOSE)["services"]["otel-collector"]["ports"]}
    assert {"4317", "4318"} <= published


def test_readme_documents_every_rule_and_alert():
    readme = (COLLECTOR / "README.md").read_text()
    for rule in _rules():
        name = rule.get("record") or rule.get("alert")
        assert f"`{name}" in readme, f"collector/README.md does not mention {name}"
    for path in (*RULES.values(), *DASHBOARD.values()):
        assert path.name in readme, f"collector/README.md does not mention {path.name}"
    assert "make dashboards" in readme
    assert "not run here" in readme.lower() and "--enable-feature=exemplar-storage" in readme


# --------------------------------------------------------------------------------------------------
# The generator


def test_shipped_dashboards_and_rules_are_the_generators_output():
    files = generated_files()
    assert {path.name for path in files} == {
        *(path.name for path in DASHBOARD.values()),
        *(path.name for path in RULES.values()),
        RULES_TEST["semconv"].name,
    }
    stale = [str(path.relative_to(ROOT)) for path, text in files.items() if path.read_text() != text]
    assert not stale, f"generated files out of date (run `make dashboards`): {stale}"


def test_generator_names_the_pin_when_another_sdk_build_is_installed(tmp_path):
    """A real other build (Grafana 10.1's, what a plain install picks) installed ahead of ours on
    sys.path: the generator stops and names the pin from pyproject."""
    other = "1769699998!10.1.0"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--target",
        str(tmp_path),
        f"{generator_sdk.SDK}=={other}",
    ]
    installed = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    if installed.returncode != 0:
        message = f"cannot install {generator_sdk.SDK}=={other}: {installed.stderr[-500:]}"
        if _require_backends():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "collector.generate", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    pin = generator_sdk.sdk_pin()
    assert pin == "1769699379!11.6.0"
    assert proc.returncode == 2, proc.stderr
    assert f"{generator_sdk.SDK} {other} is installed" in proc.stderr
    assert f"{generator_sdk.SDK}=={pin}" in proc.stderr and "Traceback" not in proc.stderr


def test_the_plugin_never_imports_the_dashboard_sdk():
    """grafana-foundation-sdk is a build-time dependency (the ``dashboards`` extra) of collector/generate only."""
    users = [
        str(path.relative_to(ROOT))
        for top in ("otel_llm", "engine_stub")
        for path in (ROOT / top).rglob("*.py")
        if "grafana_foundation_sdk" in path.read_text() or "collector.generate" in path.read_text()
    ]
    assert not users, users


def test_the_evictor_threshold_is_an_option_and_must_be_a_bucket_boundary(capsys):
    from collector.generate.__main__ import main

    rules = generated_files(5.0)[paths.RULES_DIR / paths.rules_file(Profile("vllm"))]
    assert 'vllm:request_num_preemptions_caused_bucket{le=~"5|5.0"}' in rules and "more than 5 preemptions" in rules
    assert main(["--check", "--evictor-threshold", "7"]) == 2
    assert "evictor threshold 7: must be one of the preemption buckets' boundaries" in capsys.readouterr().err
    with pytest.raises(ValueError, match="evictor threshold 0.25"):
        Profile("semconv", 0.25)
