"""The SDK's logs (``opentelemetry.sdk._logs``, its only logs module) and the Logs API
(``opentelemetry._logs``): the names otel_llm uses,
under their current names (SDK 1.39 renamed LogExporter to LogRecordExporter and kept the old
names, deprecated); and whether the Logs API emits log-based events (``event_name``, 1.38+)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from opentelemetry import _logs as _logs_api
from opentelemetry.sdk import _logs as _sdk_logs
from opentelemetry.sdk._logs import export as _export

from otel_llm._sdk import require

NoOpLoggerProvider = _logs_api.NoOpLoggerProvider
LoggerProvider = _sdk_logs.LoggerProvider
BatchLogRecordProcessor = _export.BatchLogRecordProcessor
SimpleLogRecordProcessor = _export.SimpleLogRecordProcessor
if TYPE_CHECKING:
    # The names type-check as the current SDK's; at run time, older SDKs have only the old names.
    from opentelemetry.sdk._logs.export import (
        ConsoleLogRecordExporter,
        InMemoryLogRecordExporter,
        LogRecordExporter,
        LogRecordExportResult,
    )
else:
    LogRecordExporter = getattr(_export, "LogRecordExporter", None) or _export.LogExporter
    LogRecordExportResult = getattr(_export, "LogRecordExportResult", None) or _export.LogExportResult
    ConsoleLogRecordExporter = getattr(_export, "ConsoleLogRecordExporter", None) or _export.ConsoleLogExporter
    InMemoryLogRecordExporter = getattr(_export, "InMemoryLogRecordExporter", None) or _export.InMemoryLogExporter


def check() -> None:
    params = inspect.signature(_logs_api.Logger.emit).parameters
    require(
        "event_name" in params and "context" in params and "attributes" in params,
        "the Logs API's Logger.emit takes keyword arguments, event_name among them (SDK 1.38+)",
    )
