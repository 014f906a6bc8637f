"""vLLM's enums as otel-llm reads them, taken from vLLM itself (the one copy): the finish reasons
(``FinishReason``, labelled by vLLM's own strings) and the engine-core event types
(``EngineCoreEventType``). Every vLLM path (the API server's deep hook and stat logger, the
engine-core stream) reads them here. They are read only from a vLLM already loaded in the process
(importing otel_llm never imports vLLM); elsewhere, or on a vLLM without them, the values every vLLM
so far has stand, said nowhere else."""

from __future__ import annotations

import sys
from typing import Any

try:
    if "vllm" not in sys.modules:
        raise ImportError("vLLM is not loaded in this process")
    from vllm.v1.engine import EngineCoreEventType, FinishReason

    QUEUED, SCHEDULED, PREEMPTED = (int(EngineCoreEventType[n]) for n in ("QUEUED", "SCHEDULED", "PREEMPTED"))
    # vLLM's label of each FinishReason value (``str(reason)``: "stop", "length", "abort", "error", "repetition").
    FINISH_REASONS: dict[int, str] = {int(reason): str(reason) for reason in FinishReason}
except Exception:  # noqa: BLE001 - no vLLM here, or one without them: the values of vLLM 0.32-0.34
    QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3
    FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}


def finish_reason(value: Any) -> str:
    """vLLM's label for a finish reason as sent on the stream (its int value); one not known here
    keeps its number, so that it is never counted under another reason."""
    return FINISH_REASONS.get(int(value), str(int(value)))
