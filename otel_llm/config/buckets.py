"""Default histogram bucket boundaries: the one source of truth, and their validation.

The vLLM families are vLLM 0.33's (``vllm/v1/metrics/buckets.py``) so that dashboards written
for vLLM read our histograms unchanged. The preemption family is ours: ``(0.5, 1, 2, ...)``
keeps every boundary positive (Ray's metrics exporter rejects boundaries <= 0) while
``le="0.5"`` holds exactly the never-preempted requests, which vLLM's ``(1, 2, ...)`` lumps
together with the once-preempted ones.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

REQUEST_NUM_PREEMPTIONS: tuple[float, ...] = (0.5, 1, 2, 3, 4, 5, 10, 20)
REQUEST_LATENCY: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip  # rows of boundaries as printed, not one number per line
TIME_TO_FIRST_TOKEN: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip  # rows of boundaries as printed, not one number per line
INTER_TOKEN_LATENCY: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip  # rows of boundaries as printed, not one number per line
ITERATION_TOKENS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# OpenTelemetry GenAI semantic conventions' advised boundaries (semconv profile).
GENAI_REQUEST_DURATION: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip  # rows of boundaries as printed, not one number per line
GENAI_TIME_TO_FIRST_TOKEN: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip  # rows of boundaries as printed, not one number per line
GENAI_TIME_PER_OUTPUT_TOKEN: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip  # rows of boundaries as printed, not one number per line

DEFAULT_MAX_MODEL_LEN = 8192


def request_tokens(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series capped at ``max_model_len`` (prompt, generation, max_tokens)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return tuple(out)
            out.append(value)
        scale *= 10


def validate_boundaries(setting: str, values: Iterable[object]) -> tuple[float, ...]:
    """Return the boundaries as floats, or raise ValueError naming the setting, value and rule."""
    try:
        bounds = tuple(float(v) for v in values)  # type: ignore[arg-type]  # any iterable of numbers; the rest is caught below
    except (TypeError, ValueError):
        raise ValueError(f"{setting}: {values!r} is not a sequence of numbers") from None
    if not bounds:
        raise ValueError(f"{setting}: empty; give at least one boundary, e.g. {REQUEST_NUM_PREEMPTIONS}")
    for i, b in enumerate(bounds):
        if not math.isfinite(b):
            raise ValueError(f"{setting}: boundary {b!r} is not finite; boundaries must be finite numbers")
        if b <= 0:
            raise ValueError(
                f"{setting}: boundary {b!r} is <= 0; boundaries must be positive "
                "(Ray's metrics exporter rejects non-positive boundaries; use 0.5 to isolate zero)"
            )
        if i and b == bounds[i - 1]:
            raise ValueError(f"{setting}: boundary {b!r} is duplicated; boundaries must be strictly increasing")
        if i and b < bounds[i - 1]:
            raise ValueError(
                f"{setting}: boundary {b!r} follows {bounds[i - 1]!r}; boundaries must be sorted ascending"
            )
    return bounds


def parse_boundaries(setting: str, text: str) -> tuple[float, ...]:
    """Parse a comma-separated environment value such as ``"0.5,1,2,5"``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values: Sequence[float] = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{setting}={text!r}: not a comma-separated list of numbers") from None
    return validate_boundaries(setting, values)
