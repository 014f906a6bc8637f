"""The transformers releases this instrumentation supports (``instrumentation_dependencies()``),
and the two the suite runs on: the oldest of the range and the newest (``transformers.mk``)."""

_instruments = ("transformers >= 5.18.0, < 5.25",)

TESTED_VERSIONS = ("5.18.0", "5.24.0")
