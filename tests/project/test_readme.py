"""The README's metric table is rendered from otel_llm.catalogue.metrics.METRICS: this keeps them in step.
And every setting's variable is documented in docs/configuration.md.

On failure, the assertion message holds the table to paste into README.md.
"""

from __future__ import annotations

from pathlib import Path

from otel_llm import TelemetryConfig
from otel_llm.catalogue.metrics import METRICS, label_key
from otel_llm.config.settings import ENV_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def _bounds(values) -> str:
    shown = [f"{v:g}" for v in values]
    return ", ".join(shown) if len(shown) <= 9 else f"{', '.join(shown[:3])} … {shown[-1]} ({len(shown)})"


def render_metric_table() -> str:
    vllm, semconv = TelemetryConfig(), TelemetryConfig(naming="semconv")
    rows = [
        "| vllm profile | semconv profile | type | unit | extra label | buckets (vllm; semconv if different) "
        "| meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        buckets = ""
        if m.kind == "histogram":
            buckets = _bounds(m.boundaries(vllm))
            if m.boundaries(semconv) != m.boundaries(vllm):
                buckets += f"; {_bounds(m.boundaries(semconv))}"
        unit = f"`{m.unit}`" if m.unit else ""
        # (tenant): only with a tenant source (OTEL_LLM_TENANT).
        labels = ([label_key(vllm, m.label)] if m.label else []) + (["(tenant)"] if m.per_tenant else [])
        label = ", ".join(labels)
        rows.append(f"| `{m.vllm}` | `{m.semconv}` | {m.kind} | {unit} | {label} | {buckets} | {m.meaning} |")
    return "\n".join(rows)


def test_metric_table_matches_the_code():
    table = render_metric_table()
    assert table in README.read_text(), "README.md metric table is out of date; paste:\n" + table


def test_every_environment_variable_is_documented():
    text = CONFIGURATION.read_text()
    missing = [var for var in ENV_VARIABLES if f"`{var}`" not in text]
    assert not missing, missing


def test_readme_leads_with_the_vllm_user_then_the_two_commands():
    """What it is, then how a vLLM user turns it on, then the demo and the developer's commands."""
    intro, use, tryit = README.read_text().split("\n## ")[:3]
    assert intro.startswith("# otel-llm\n") and use.startswith("Use it with vLLM\n")
    assert "pip install otel-llm" in use and "VLLM_USE_RUST_FRONTEND=1 vllm serve" in use
    assert "make demo " in tryit and "make test " in tryit


def test_readme_stays_a_front_page():
    assert len(README.read_text().splitlines()) <= 250, "move the detail into docs/"
