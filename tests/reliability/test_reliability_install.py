"""An optional part installed without its extra fails in one line that names the install."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

WITHOUT_INSTRUMENTATION = "import sys; sys.modules['opentelemetry.instrumentation'] = None; "


@pytest.mark.parametrize(
    "load",
    [
        "import otel_llm.integrations.transformers",
        # What opentelemetry-instrument and other entry-point loaders do.
        "from importlib.metadata import entry_points; "
        "[ep] = [e for e in entry_points(group='opentelemetry_instrumentor') if e.name == 'otel_llm_transformers']; "
        "ep.load()",
    ],
)
def test_transformers_instrumentor_without_its_extra_names_the_install(load: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_INSTRUMENTATION + load], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ModuleNotFoundError: otel_llm\.integrations\.transformers needs opentelemetry-instrumentation "
        r"\(opentelemetry\.instrumentation[.\w]* is missing\): pip install 'otel-llm\[transformers\]'",
        last,
    ), last
    assert "During handling" not in run.stderr  # one error, not a chain
