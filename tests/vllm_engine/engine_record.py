"""The engine core's own record of its preemptions, which the real-engine tests hold otel-llm's
series against: ``preemption_truth/sitecustomize.py``, put on the served engine's path by
:func:`recording_env`, writes one JSON line per preemption (victim, cause, their priorities and
adapters). And scraped /metrics samples: once they count a load, and their sums by a label."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from otel_llm.testing.vllm.server import scrape
from tests.support.backends import wait_until

TRUTH_RECORDER = Path(__file__).resolve().parent / "preemption_truth"
Samples = dict[tuple[str, frozenset], float]


def recording_env(record: Path) -> dict[str, str]:
    """What a server's environment adds so that its engine core writes its record to ``record``."""
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(TRUTH_RECORDER), os.environ.get("PYTHONPATH")) if p),
        "OTEL_LLM_TEST_PREEMPTION_TRUTH": str(record),
    }


def read_record(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed by the value of ``label``."""
    out: Counter[str] = Counter()
    for (n, labels), v in samples.items():
        if n == name:
            out[dict(labels)[label]] += v
    return dict(out)


def matrix(samples: Samples) -> dict[tuple[str, str], float]:
    """The tenant matrix's non-zero cells: (victim's tenant, cause's tenant) -> preemptions."""
    return {
        (dict(labels)["tenant"], dict(labels)["cause_tenant"]): v
        for (n, labels), v in samples.items()
        if n == "vllm:num_preemptions_by_tenant_total" and v
    }


def scrape_once_counted(url: str, requests: int) -> Samples:
    """``url``'s samples once they count ``requests`` finished (at most 60 s)."""

    def counted() -> Samples:
        samples = scrape(url)
        return samples if total(samples, "vllm:request_success_total") >= requests else {}

    return wait_until(counted, 60, interval=0.2, what=f"{requests} requests counted at {url}")
