"""Phoenix for tests: :func:`otel_llm.stack.phoenix.start_phoenix`, with "cannot start" turned
into a skip, or a failure under ``OTEL_LLM_REQUIRE_BACKENDS=1`` (tests.support.backends)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from otel_llm.stack.phoenix import Phoenix, PhoenixUnavailable, start_phoenix
from tests.support.backends import require_backend


@contextlib.contextmanager
def phoenix_backend(explicit: str | None = None, ready_timeout_s: float | None = None) -> Iterator[Phoenix]:
    with contextlib.ExitStack() as stack:
        try:
            kwargs = {} if ready_timeout_s is None else {"ready_timeout_s": ready_timeout_s}
            phoenix = stack.enter_context(start_phoenix(explicit, **kwargs))
        except PhoenixUnavailable as exc:
            require_backend("phoenix", str(exc))
        yield phoenix
