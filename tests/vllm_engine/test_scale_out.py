"""Many processes, one truth, on vLLM's real engine: ``vllm serve --api-server-count 2`` and
``vllm serve --data-parallel-size 2`` (two engine cores, and as many API servers).

Every API-server process loads the plugin and pushes OTLP with its own ``service.instance.id``
to one receiver. Summed over the processes, per ``engine``, the plugin's totals equal vLLM's own
aggregated /metrics (its Prometheus multiprocess registry); every request has exactly one span,
in the caller's trace, whichever process served it. The scheduler gauges (running, waiting, KV
usage, waiting by reason) are vLLM's "most recent over the API servers": exactly one process
exports them per engine, and their sum equals vLLM's, after the load and in the middle of one
(held still by vLLM's /pause?mode=keep, a dev-mode endpoint, so both sides read the same state).
Every preemption's cause, as the engine cores recorded it (tests/vllm_engine/preemption_truth),
reaches the API server of its victim, and every cause's own server counts it.
"""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

import pytest
from engine_record import read_record, recording_env

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import ADD_MODE, MODEL_NAME, Load, VllmServer, run_load, scrape, traceparent
from tests.support.backends import start_otlp_sink, wait_until

LOAD = Load(requests=32, concurrency=32, max_tokens=48, seed=3)
# Held mid-flight by a pause: long requests, four times as many as vLLM runs at once (16, and
# fewer fit the KV blocks), so that requests wait through most of the load, not only its start.
HELD = Load(requests=64, concurrency=64, max_tokens=200, min_prompt=32, max_prompt=56, seed=4, traced=False)
SCHEDULER_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
)
# A mid-load state has requests both running and waiting.
GAUGE_STATE = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# Series whose sums over processes must equal vLLM's aggregate (sample names).
SUMMED = (
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_num_preemptions_count",
    "vllm:request_num_preemptions_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_generation_tokens_sum",
    "vllm:cache_config_info",  # set by every API server itself: exported by one
    "vllm:engine_sleep_state",
)


def _state(samples: dict[tuple[str, frozenset], float]) -> dict[str, float]:
    """Requests running and waiting in vLLM's samples, summed over label sets."""
    return {name: sum(v for (n, _), v in samples.items() if n == name) for name in GAUGE_STATE}


def _last_exports(sink: Any) -> dict[tuple[str, str, frozenset], float]:
    """The last export of each process: {(Prometheus sample name, instance, labels): value}."""
    last: dict[tuple[str, str, frozenset], float] = {}
    with sink.lock:
        requests = list(sink.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            instance = next(a.value.string_value for a in rm.resource.attributes if a.key == "service.instance.id")
            for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    labels = frozenset((a.key, a.value.string_value) for a in p.attributes)
                    if kind == "sum":
                        last[(m.name + "_total", instance, labels)] = p.as_int or p.as_double
                    elif kind == "histogram":
                        last[(m.name + "_count", instance, labels)] = p.count
                        last[(m.name + "_sum", instance, labels)] = p.sum
                    elif kind == "gauge":
                        last[(m.name, instance, labels)] = p.as_int or p.as_double
    return last


def _summed_over_processes(sink: Any) -> tuple[dict[tuple[str, frozenset], float], set[str]]:
    """The last export of each process, summed over processes, as Prometheus sample names."""
    last = _last_exports(sink)
    totals: dict[tuple[str, frozenset], float] = defaultdict(float)
    for (name, _, labels), value in last.items():
        totals[(name, labels)] += value
    return dict(totals), {instance for _, instance, _ in last}


def _gauges(server: VllmServer, sink: Any) -> dict[str, Any]:
    """vLLM's scheduler gauges and ours (summed over processes), and how many processes export
    each of ours, once ours equal vLLM's (each process exports every 0.5 s; bounded wait)."""

    def read() -> dict[str, Any]:
        theirs = {k: v for k, v in scrape(server.url + "/metrics").items() if k[0] in SCHEDULER_GAUGES}
        last = _last_exports(sink)
        ours: dict[tuple[str, frozenset], float] = defaultdict(float)
        exporters: dict[tuple[str, frozenset], int] = defaultdict(int)
        for (name, _, labels), value in last.items():
            if name in SCHEDULER_GAUGES:
                ours[(name, labels)] += value
                exporters[(name, labels)] += 1
        return {"theirs": theirs, "ours": dict(ours), "exporters": dict(exporters)}

    try:
        return wait_until(
            lambda: (g := read())["theirs"] == g["ours"] and g,
            30,
            interval=0.25,
            what="our scheduler gauges to equal vLLM's",
        )
    except TimeoutError:
        g = read()
        differ = {k: (v, g["ours"].get(k)) for k, v in g["theirs"].items() if g["ours"].get(k) != v}
        raise AssertionError(
            f"scheduler gauges (vLLM's, ours summed over processes) differ: {differ}; exporters {g['exporters']}"
        ) from None


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, response.read()


def _paused_mid_load(server: VllmServer, sink: Any, attempts: int = 4) -> dict[str, Any] | str:
    """The gauges while HELD's requests are frozen mid-flight (vLLM's /pause?mode=keep: no engine
    step, so no new SchedulerStats, until /resume); then the requests finish. A load that is not
    caught mid-flight (it ends before it is seen with requests both running and waiting, on 2
    shared cores, or vLLM reads none running or none waiting once paused) is run again,
    ``attempts`` times at most; then the reason why there is no mid-load state (the other tests
    of the module still run)."""

    def running_and_waiting() -> bool:
        return all(_state(scrape(server.url + "/metrics")).values())

    seen: list[dict[str, float]] = []
    for _ in range(attempts):
        gauges = _hold_once(server, sink, running_and_waiting, seen)
        if gauges is not None:
            return gauges
    return (
        f"the held requests were not caught mid-flight in {attempts} attempts (a busy machine); "
        f"vLLM's gauges once paused: {seen}"
    )


def _hold_once(
    server: VllmServer, sink: Any, running_and_waiting: Any, seen: list[dict[str, float]]
) -> Optional[dict[str, Any]]:
    """One HELD load: the gauges while it is paused, or None when it ended before it was seen
    with requests running and waiting, or vLLM's gauges read none running or none waiting once
    it was paused (what they read is appended to ``seen``)."""
    completions: list = []
    load = threading.Thread(target=lambda: completions.extend(run_load(server.url, HELD)))
    load.start()
    try:
        wait_until(
            lambda: not load.is_alive() or running_and_waiting(), 60, interval=0.05, what="requests running and waiting"
        )
        if not load.is_alive():
            return None
        _post(server.url + "/pause?mode=keep")
        try:
            gauges = _gauges(server, sink)
        finally:
            _post(server.url + "/resume")
        # vLLM's own gauges sometimes read none running, or none waiting, once paused (its last
        # stats, not ours): equal, but not the state this is for; the caller runs the load again.
        seen.append(_state(gauges["theirs"]))
        return gauges if all(seen[-1].values()) else None
    finally:
        load.join(300)
        assert not load.is_alive()
        assert [c.status for c in completions] == [200] * HELD.requests, completions


@pytest.fixture(
    scope="module",
    params=[["--api-server-count", "2"], ["--data-parallel-size", "2"]],
    ids=["api-server-count-2", "data-parallel-size-2"],
)
def scaled(request: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    truth_file = tmp_path_factory.mktemp("truth") / "preemptions.jsonl"
    with start_otlp_sink("grpc") as sink:
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            **recording_env(truth_file),
            **ADD_MODE,
        }
        with VllmServer(tiny_model, env=env, args=request.param, cli=True) as server:
            completions = run_load(server.url, LOAD)
            assert [c.status for c in completions] == [200] * LOAD.requests
            theirs = {k: v for k, v in scrape(server.url + "/metrics").items() if k[0] in SUMMED}
            assert theirs

            def differ() -> dict:
                ours, _ = _summed_over_processes(sink)
                return {k: (v, ours.get(k)) for k, v in theirs.items() if ours.get(k) != v}

            # Each process exports every 0.5 s: wait for the exports after the load (bounded).
            try:
                wait_until(lambda: not differ(), 60, interval=0.25, what="the processes' exports")
            except TimeoutError:
                raise AssertionError(f"sums over processes differ from vLLM's: {differ()}") from None
            wait_until(lambda: len(sink.spans()) >= LOAD.requests, 60, interval=0.25, what="every request span")
            ours, instances = _summed_over_processes(sink)
            truth = read_record(truth_file)  # the load's alone
            engines = {"0", "1"} if "--data-parallel-size" in request.param else {"0"}
            drained = _gauges(server, sink)
            return {
                "theirs": theirs,
                "ours": ours,
                "instances": instances,
                "spans": list(sink.spans()),
                "truth": truth,
                "log": server.log_text(),
                "engines": engines,
                "drained": drained,
                "mid_load": _paused_mid_load(server, sink) if engines == {"0"} else None,
            }


def test_every_api_server_process_loads_the_plugin_with_its_own_identity(scaled: dict[str, Any]) -> None:
    assert len(scaled["instances"]) == 2
    loads = [line for line in scaled["log"].splitlines() if "otel_llm -> otel_llm.integrations.vllm" in line]
    assert len(loads) == 2


def test_totals_over_processes_equal_vllms_aggregated_metrics_per_engine(scaled: dict[str, Any]) -> None:
    theirs, ours = scaled["theirs"], scaled["ours"]
    differ = {k: (v, ours.get(k)) for k, v in theirs.items() if ours.get(k) != v}
    assert not differ, differ
    success = sum(v for (name, _), v in theirs.items() if name == "vllm:request_success_total")
    assert success == LOAD.requests
    assert sum(v for (name, _), v in theirs.items() if name == "vllm:num_preemptions_total") > 0
    per_engine = [dict(labels) for (name, labels) in theirs if name != "vllm:cache_config_info"]  # no engine label
    assert {labels["engine"] for labels in per_engine} == scaled["engines"]
    assert all(labels["model_name"] == MODEL_NAME for labels in per_engine)


def test_one_span_per_request_in_the_callers_trace_whichever_process_served_it(scaled: dict[str, Any]) -> None:
    spans = [s for s in scaled["spans"] if s.name == "llm_request"]
    assert len(spans) == LOAD.requests
    by_trace = {s.trace_id.hex(): s for s in spans}
    for i in range(LOAD.requests):
        _, trace_id, span_id = traceparent(i, LOAD.seed)
        assert by_trace[trace_id].parent_span_id.hex() == span_id


def test_every_preemption_s_cause_reaches_its_victim_s_server_and_its_cause_s(scaled: dict[str, Any]) -> None:
    """Each engine core tells every API server; each applies what it has: its victims' causes,
    and the preemptions its requests caused. A cause served by the other API server is named by
    vLLM's internal id, without a link (its span is the other process's)."""
    truth, spans = scaled["truth"], [s for s in scaled["spans"] if s.name == "llm_request"]
    assert truth and all(t["where"] == "schedule" for t in truth)
    by_id = {span_attributes(s)["gen_ai.request.id"]: s for s in spans}
    external = {t["victim"]: t["victim"].rsplit("-", 1)[0] for t in truth} | {
        t["cause"]: t["cause"].rsplit("-", 1)[0] for t in truth
    }
    for t in truth:
        span = by_id[external[t["victim"]]]
        event = [span_attributes(e) for e in span.events if e.name == "preempted"][t["ordinal"] - 1]
        assert event["cause"] == ("self" if t["cause"] == t["victim"] else "request"), t
        (named,) = event["cause_request_ids"]
        links = {
            (span_attributes(link)["llm.preemption.ordinal"], link.span_id)
            for link in span.links
            if span_attributes(link)["llm.preemption.ordinal"] == t["ordinal"]
        }
        if t["cause"] == t["victim"]:
            assert named == external[t["victim"]] and not links, t
        elif named == external[t["cause"]]:  # served by the same API server: linked
            assert links == {(t["ordinal"], by_id[named].span_id)}, t
        else:
            assert named == t["cause"] and not links, t
    caused = Counter(external[t["cause"]] for t in truth)
    for rid, span in by_id.items():
        assert span_attributes(span)["llm.request.num_preemptions_caused"] == caused.get(rid, 0), rid
    by_cause: Counter[str] = Counter()
    for (name, labels), value in scaled["ours"].items():
        if name == "vllm:num_preemptions_by_cause_total":
            by_cause[dict(labels)["cause"]] += value
    kinds = Counter("self" if t["cause"] == t["victim"] else "request" for t in truth)
    assert {k: v for k, v in by_cause.items() if v} == dict(kinds)


def _per_engine(gauges: dict[tuple[str, frozenset], float], name: str) -> dict[str, float]:
    return {dict(labels)["engine"]: v for (n, labels), v in gauges.items() if n == name}


def _assert_once_per_engine_as_vllm(gauges: dict[str, Any], engines: set[str]) -> None:
    theirs, ours = gauges["theirs"], gauges["ours"]
    assert ours == theirs
    assert set(gauges["exporters"]) == set(theirs)
    assert set(gauges["exporters"].values()) == {1}  # one process per engine reports them
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert set(_per_engine(theirs, name)) == engines
    for engine in engines:
        by_reason = {
            dict(labels)["reason"]: v
            for (n, labels), v in theirs.items()
            if n == "vllm:num_requests_waiting_by_reason" and dict(labels)["engine"] == engine
        }
        assert sum(by_reason.values()) == _per_engine(theirs, "vllm:num_requests_waiting")[engine]


def test_scheduler_gauges_after_the_load_are_vllms_reported_once_per_engine(scaled: dict[str, Any]) -> None:
    drained = scaled["drained"]
    _assert_once_per_engine_as_vllm(drained, scaled["engines"])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert set(_per_engine(drained["ours"], name).values()) == {0}


def test_scheduler_gauges_mid_load_are_vllms_reported_once_per_engine(scaled: dict[str, Any]) -> None:
    mid = scaled["mid_load"]
    if mid is None:
        pytest.skip(
            "with --data-parallel-size 2, vLLM 0.32's own gauges read 0 running / 0 waiting while paused "
            "(seen here, cause not investigated): no mid-load state to compare"
        )
    if isinstance(mid, str):
        pytest.skip(mid)
    _assert_once_per_engine_as_vllm(mid, scaled["engines"])
    assert sum(_per_engine(mid["theirs"], "vllm:num_requests_running").values()) > 0
    assert sum(_per_engine(mid["theirs"], "vllm:num_requests_waiting").values()) > 0
    assert sum(_per_engine(mid["theirs"], "vllm:kv_cache_usage_perc").values()) > 0
