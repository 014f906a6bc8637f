"""`otel-llm doctor` beside vLLM's real classes (each release of the matrix): which parts attach,
and, on a doctored Scheduler or IterationStats, which do not and why, with exit status 1 when
the settings ask for them."""

from __future__ import annotations

import io

import pytest

from otel_llm.cli.doctor import doctor
from otel_llm.integrations.vllm import package

STATUSES = ("ok", "ready", "no", "FAIL")
DEEP = {"OTEL_LLM_VLLM_DEEP_HOOK": "1", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "prometheus"}


def run(environ: dict[str, str]) -> tuple[int, dict[str, str], str]:
    out = io.StringIO()
    status = doctor(out, environ)
    text = out.getvalue()
    # "  status name                       what": status in columns 2-6, the name in 8-33.
    rows = {line[8:34].strip(): line[2:7].strip() for line in text.splitlines() if line[2:7].strip() in STATUSES}
    return status, rows, text


def test_every_part_attaches_on_this_release() -> None:
    status, rows, text = run(DEEP)
    assert status == 0, text
    assert f"vLLM          {package.installed()}: proven in CI" in text
    assert [rows[p] for p in ("vLLM stat logger", "vLLM deep hook", "vLLM frontend part", "vLLM attribution")] == [
        "ok"
    ] * 4
    assert rows["vLLM replace mode"] == "ok" and rows["vLLM Rust frontend"] == "ready"  # replace: the default


def test_replace_mode_fails_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default where it can run; where this vLLM would build its own logger anyway, a note
    (add mode runs), and a failure only when OTEL_LLM_VLLM_METRICS=replace asks for it."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    status, rows, text = run({**DEEP, "OTEL_LLM_VLLM_METRICS": "add"})
    assert status == 0 and rows["vLLM replace mode"] == "ready", text

    def init(self, vllm_config, *args, **kwargs):  # a future vLLM that always builds its own logger
        pass

    monkeypatch.setattr(StatLoggerManager, "__init__", init)
    status, rows, text = run(DEEP)
    assert status == 0 and rows["vLLM replace mode"] == "no", text
    assert "does not leave its PrometheusStatLogger out for a custom one" in text
    status, rows, text = run({**DEEP, "OTEL_LLM_VLLM_METRICS": "replace"})
    assert status == 1 and rows["vLLM replace mode"] == "FAIL", text


def test_the_deep_hook_is_asked_for_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default: where it cannot attach the doctor fails, unless OTEL_LLM_VLLM_DEEP_HOOK=0."""
    from vllm.v1.metrics.stats import IterationStats

    default = {k: v for k, v in DEEP.items() if k != "OTEL_LLM_VLLM_DEEP_HOOK"}
    status, rows, text = run(default)
    assert status == 0 and rows["vLLM deep hook"] == "ok", text
    monkeypatch.delattr(IterationStats, "update_from_finished_request")
    status, rows, text = run(default)
    assert status == 1 and rows["vLLM deep hook"] == "FAIL", text
    assert "  FAIL  vLLM deep hook" in text and "(on unless OTEL_LLM_VLLM_DEEP_HOOK=0)" in text
    status, rows, text = run({**default, "OTEL_LLM_VLLM_DEEP_HOOK": "0"})
    assert status == 0 and rows["vLLM deep hook"] == "no", text


def test_a_release_ci_does_not_prove_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.1")
    status, _, text = run(DEEP)
    assert status == 0 and "vLLM          0.99.1: not among the releases CI proves" in text, text


def test_a_scheduler_without_the_loops_locals_fails_attribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(self):  # a future vLLM's loop, its locals renamed
        victim = None
        return victim

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    status, rows, text = run(DEEP)
    assert status == 1 and rows["vLLM attribution"] == "FAIL", text
    assert "Scheduler.schedule has no locals request / preempted_req" in text
    assert text.rstrip().endswith("not attached or not reachable: vLLM attribution")
    status, rows, _ = run({**DEEP, "OTEL_LLM_VLLM_DEEP_HOOK": "0"})  # not asked for: a note
    assert status == 0 and rows["vLLM attribution"] == "no"


def test_a_renamed_method_and_a_changed_parameter_fail_the_deep_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    def update_from_events(self, events, req_stats):  # a changed parameter list
        pass

    monkeypatch.setattr(IterationStats, "update_from_events", update_from_events)
    monkeypatch.delattr(OutputProcessor, "propagate_error")  # a renamed method
    status, rows, text = run(DEEP)
    assert status == 1 and rows["vLLM deep hook"] == "FAIL" and rows["vLLM frontend part"] == "FAIL", text
    assert "IterationStats.update_from_events has parameters" in text
    assert "propagate_error not found on AsyncLLM / OutputProcessor" in text


def test_the_rust_frontend_attaches_and_a_changed_stream_fails_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    status, rows, text = run({**DEEP, "VLLM_USE_RUST_FRONTEND": "1"})
    assert status == 0 and rows["vLLM Rust frontend"] == "ok", text

    def send(socket, buffers, copy):  # a future vLLM's hand-over, another parameter list
        pass

    monkeypatch.setattr(EngineCoreProc, "_send_msg_tracking_payload", staticmethod(send))
    status, rows, text = run({**DEEP, "VLLM_USE_RUST_FRONTEND": "1"})
    assert status == 1 and rows["vLLM Rust frontend"] == "FAIL", text
    assert "EngineCoreProc._send_msg_tracking_payload(socket, buffers), a staticmethod, not found" in text


def test_the_tenant_source_is_said_for_each_vllm_frontend() -> None:
    """vLLM's two frontends hand over the same tenant facts (priority, adapter, model): a header
    or baggage source is refused by both and fails the doctor."""
    local = {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"}
    status, _, text = run({**local, "OTEL_LLM_TENANT": "priority"})
    assert "  tenant priority (at most 20 values): reaches vllm, vllm-engine-core" in text, text
    status, _, text = run({**local, "OTEL_LLM_TENANT": "header:x-team"})
    assert status == 1, text
    assert (
        "reaches none of the entry points here; refused by vllm hands over priority, lora, model; "
        "vllm-engine-core hands over priority, lora, model"
    ) in text, text
