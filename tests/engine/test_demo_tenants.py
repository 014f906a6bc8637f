"""``otel-llm demo --tenants N``: what it prints of each tenant and of who hurt whom equals the
engine's own record (each output's ``preempted_by``) and the workload's tenants."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest

from otel_llm.cli.render import bucket_labels

ROW = re.compile(r"^  (\d+)\s+(\d+)\s+(\d+)\s+((?:\s*\d+)+)$")
CELL = re.compile(r"(\d+) \((\d+)%\)|(?<!\S)(0)(?!\S)")


def test_demo_prints_each_tenant_and_the_matrix_as_the_engine_recorded_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import engine_stub.workload
    from otel_llm.cli import main

    monkeypatch.delenv("OTEL_LLM_TENANT", raising=False)
    runs: list[tuple[Any, Any]] = []
    run_workload = engine_stub.workload.run_workload

    def recorded_run(engine: Any, requests: Any, **kwargs: Any) -> Any:
        runs.append((requests, run_workload(engine, requests, **kwargs)))
        assert engine.scheduler.policy == "priority"
        return runs[-1][1]

    monkeypatch.setattr(engine_stub.workload, "run_workload", recorded_run)
    assert main(["demo", "--tenants", "3", "--requests", "150", "--prometheus-port", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    [(requests, result)] = runs
    tenant = {r.request_id: str(r.priority) for r in requests}
    assert set(tenant.values()) == {"0", "1", "2"}
    truth = Counter((tenant[o.request_id], tenant[c]) for o in result.outputs for c in o.preempted_by)
    assert sum(truth.values()) >= 50 and any(v != c for v, c in truth)

    section = out.split("tenants (OTEL_LLM_TENANT=priority)\n", 1)[1]
    per_tenant, matrix = section.split("who hurt whom", 1)
    labels = bucket_labels((0.5, 1, 2, 3, 4, 5, 10, 20))
    expected_rows = {}
    for t in ("0", "1", "2"):
        counts = [o.num_preemptions for o in result.outputs if tenant[o.request_id] == t]
        buckets = Counter(_label(n, labels) for n in counts)
        expected_rows[t] = (len(counts), sum(counts), [buckets[label] for label in labels])
    rows = {
        m[1]: (int(m[2]), int(m[3]), [int(x) for x in m[4].split()])
        for line in per_tenant.splitlines()
        if (m := ROW.match(line))
    }
    assert rows == expected_rows

    lines = matrix.splitlines()
    header = lines[1].split()
    assert header[0] == "victim" and header[-1] == "total"
    causes = header[1:-1]
    printed = {}
    for line in lines[2:5]:
        victim, rest = line.split(maxsplit=1)
        cells = [int(m[1] or m[3]) for m in CELL.finditer(rest.rsplit(maxsplit=1)[0])]
        printed.update({(victim, c): n for c, n in zip(causes, cells) if n})
        assert int(rest.split()[-1]) == sum(truth[(victim, c)] for c in causes)
    assert printed == dict(truth)
    assert "  the telemetry equals the engine record" in lines


def _label(n: int, labels: list[str]) -> str:
    for label in labels:
        low, _, high = label.rstrip("+").partition("-")
        if label.endswith("+") and n >= int(low) or int(low) <= n <= int(high or low):
            return label
    raise AssertionError(n)
