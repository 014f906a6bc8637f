"""`make demo` passes each option once: --serve-seconds from SERVE_SECONDS, the rest from ARGS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def demo_command(*overrides: str) -> list[str]:
    """The command `make demo` would run (dry run; DEMO_READY= leaves out the set-up)."""
    out = subprocess.run(
        ["make", "-s", "-n", "demo", "DEMO_READY=", *overrides], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    [line] = [line for line in out.splitlines() if "otel-llm demo" in line]
    return line.split()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_passes_serve_seconds_once() -> None:
    default = demo_command()
    assert default.count("--serve-seconds") == 1 and default[default.index("--serve-seconds") + 1] == "20"
    custom = demo_command("SERVE_SECONDS=0", "ARGS=--requests 100")
    assert custom.count("--serve-seconds") == 1 and custom[custom.index("--serve-seconds") + 1] == "0"
    assert custom[-2:] == ["--requests", "100"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_sets_up_only_what_the_demo_needs(tmp_path: Path) -> None:
    """The engine and the chart: no dev extras, no Prometheus or valgrind, no Phoenix."""
    plan = subprocess.run(
        ["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    installs = [line for line in plan.splitlines() if "install" in line]
    assert installs == [
        f"{tmp_path / 'venv'}/bin/python -m pip install -q torch==2.13.0",
        f"{tmp_path / 'venv'}/bin/python -m pip install -q -e '.[engine,plot]'",
    ], plan


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_quick_runs_no_backend_and_needs_no_phoenix() -> None:
    plan = subprocess.run(
        ["make", "-n", "test-quick", "READY=", "PHOENIX_READY=/nonexistent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [run] = [line for line in plan.replace("\\\n", " ").splitlines() if "-m pytest" in line]
    assert "-m 'not backend'" in run and "phoenix" not in plan
    skipped = [word.split("=", 1)[1] for word in run.split() if word.startswith("--ignore=")]
    assert skipped and all((ROOT / path).is_file() for path in skipped), skipped


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_sets_up_everything_it_runs(tmp_path: Path) -> None:
    """On a fresh machine `make test` installs Phoenix too (the drill-down tests need it), so CI
    runs nothing before it but the lint."""
    fresh = {f"{name}={tmp_path / name}" for name in ("VENV", "PHOENIX_VENV", "SDK_OLDEST_VENV")}
    for target in ("test", "test-sdk-oldest"):
        plan = subprocess.run(
            ["make", "-n", target, *sorted(fresh)], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        assert "torch==2.13.0" in plan and "arize-phoenix==" in plan and "prometheus" in plan, target
    ci = (ROOT / ".ci" / "run").read_text()
    targets = [line.split()[1] for line in ci.splitlines() if line.startswith("make ")]
    assert targets == ["lint", "test", "test-sdk-oldest", "test-vllm", "test-transformers"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_release_matrices_are_the_packages_releases() -> None:
    """`make test-vllm-classes` runs tests/vllm once per release PROVEN marks "classes", each in
    its venv; `make test-transformers` on package.py's oldest and newest: one line adds a release."""
    import importlib.util

    from otel_llm.integrations.vllm.package import PROVEN

    # The file alone: its package's __init__ needs opentelemetry-instrumentation.
    spec = importlib.util.spec_from_file_location("package", ROOT / "otel_llm/integrations/transformers/package.py")
    assert spec is not None and spec.loader is not None
    transformers_package = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(transformers_package)

    def plan(target: str) -> str:
        return subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    runs = [line.split() for line in plan("test-vllm-classes").splitlines() if "-m pytest" in line]
    pythons = [words[words.index("-m") - 1] for words in runs]
    classes = [release for release, how in PROVEN.items() if how == "classes"]
    assert len(classes) >= 2 and pythons == [f".venv-vllm-{release}/bin/python" for release in classes]
    transformers = plan("test-transformers")
    oldest, newest = transformers_package.TESTED_VERSIONS[0], transformers_package.TESTED_VERSIONS[-1]
    assert f'"transformers[serving]=={newest}"' in transformers and f'"transformers[serving]=={oldest}"' in transformers
