"""Under vLLM's Python frontend, with a tenant source: each engine step's time to first token,
inter-token latencies and prompt / generation token counts split by the tenant of the request
each came from.

vLLM's ``IterationStats`` keeps them as per-step lists and sums that name no request. Its
``update_from_output(output, engine_core_timestamp, is_prefilling, req_stats, ...)``, called by
the output processor once per request output, appends one time to first token when the request
was prefilling, else one inter-token latency, and adds the output's new tokens and, in prefill,
its prompt tokens. A wrapper (:func:`wrapper`, installed by the deep hook only when a tenant
source needs it) notes each call's ``(req_stats, is_prefilling, output)`` on the
``IterationStats``; the step translator (:func:`split`) pairs the notes with vLLM's values in
order, each request's tenant from the trace the deep hook keeps on its ``req_stats``. Where the
notes do not account for vLLM's values exactly (a vLLM that computes them otherwise), the step
is recorded under the tenant of a request with no facts, said once: the sums stay vLLM's.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from otel_llm.integrations.vllm.frontend.traces import TRACE_ATTR, RequestTrace
from otel_llm.integrations.vllm.translation.fields import FieldReader
from otel_llm.integrations.vllm.translation.translate import ITERATION_COUNTS, ITERATION_LATENCIES

NOTES_ATTR = "_otel_llm_outputs"  # on an IterationStats: [(req_stats, is_prefilling, output)]
_PARAMETERS = ["self", "output", "engine_core_timestamp", "is_prefilling", "req_stats"]
_TTFTS, _ITLS = ITERATION_LATENCIES
_PROMPT, _GENERATION = (f for f in ITERATION_COUNTS if f.ours in ("prompt_tokens", "generation_tokens"))


def shape_problem(stats_cls: type) -> Optional[str]:
    """Why the notes cannot be taken on this vLLM's ``IterationStats``, or None."""
    method = getattr(stats_cls, "update_from_output", None)
    if method is None:
        return "IterationStats.update_from_output not found"
    parameters = list(inspect.signature(method).parameters)
    if parameters[:5] != _PARAMETERS:
        return f"IterationStats.update_from_output has parameters {parameters}"
    return None


def wrapper(original: Callable, warn_once: Callable[[str, BaseException], None]) -> Callable:
    """``IterationStats.update_from_output``, noting what each call was about (the hot path:
    one tuple per request output, nothing read)."""

    def update_from_output(
        self: Any, output: Any, engine_core_timestamp: Any, is_prefilling: Any, req_stats: Any, *args: Any, **kw: Any
    ) -> Any:
        result = original(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kw)
        try:
            notes = self.__dict__.get(NOTES_ATTR)
            if notes is None:
                notes = self.__dict__[NOTES_ATTR] = []
            notes.append((req_stats, is_prefilling, output))
        except Exception as exc:  # noqa: BLE001 - never into vLLM's output processor
            warn_once("noting the tenant of a step's values", exc)
        return result

    return update_from_output


class TenantStep:
    """One tenant's share of engine steps: its latencies and token counts."""

    __slots__ = ("ttfts", "itls", "prompt_tokens", "generation_tokens")

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add(self, other: "TenantStep") -> None:
        self.ttfts += other.ttfts
        self.itls += other.itls
        self.prompt_tokens += other.prompt_tokens
        self.generation_tokens += other.generation_tokens


def split(
    it: Any, reader: FieldReader, tenant_of: Callable[[Optional[RequestTrace]], str], into: dict[str, TenantStep]
) -> None:
    """Add one ``IterationStats``' values to ``into``, by tenant (``tenant_of`` a request's trace,
    None for a request without one)."""
    whole = TenantStep()
    whole.ttfts = list(reader.sequence(it, _TTFTS.vllm, _TTFTS.metric))
    whole.itls = list(reader.sequence(it, _ITLS.vllm, _ITLS.metric))
    whole.prompt_tokens = int(reader.number(it, _PROMPT.vllm, _PROMPT.metric) or 0)
    whole.generation_tokens = int(reader.number(it, _GENERATION.vllm, _GENERATION.metric) or 0)
    if not (whole.ttfts or whole.itls or whole.prompt_tokens or whole.generation_tokens):
        return
    notes = getattr(it, NOTES_ATTR, None)
    parts = _by_note(notes, whole, tenant_of, reader) if notes else None
    if parts is None:
        parts = {tenant_of(None): whole}
    for tenant, part in parts.items():
        mine = into.get(tenant)
        if mine is None:
            into[tenant] = part
        else:
            mine.add(part)


def _by_note(
    notes: list[tuple[Any, Any, Any]],
    whole: TenantStep,
    tenant_of: Callable[[Optional[RequestTrace]], str],
    reader: FieldReader,
) -> Optional[dict[str, TenantStep]]:
    """vLLM's values of one step (``whole``) by the tenant of each note's request, in order; None
    where the notes do not account for them exactly."""
    parts: dict[str, TenantStep] = {}
    ttfts, itls = whole.ttfts, whole.itls
    n_ttft = n_itl = prompt = generation = 0
    for req_stats, prefilling, output in notes:
        trace = getattr(req_stats, TRACE_ATTR, None)
        tenant = tenant_of(trace if isinstance(trace, RequestTrace) else None)
        part = parts.get(tenant)
        if part is None:
            part = parts[tenant] = TenantStep()
        new_tokens = getattr(output, "new_token_ids", None)
        tokens = len(new_tokens) if new_tokens is not None else 0
        generation += tokens
        part.generation_tokens += tokens
        if prefilling:
            if n_ttft < len(ttfts):
                part.ttfts.append(ttfts[n_ttft])
            n_ttft += 1
            count = getattr(getattr(output, "prefill_stats", None), "num_prompt_tokens", 0)
            count = count if type(count) is int else 0
            prompt += count
            part.prompt_tokens += count
        else:
            if n_itl < len(itls):
                part.itls.append(itls[n_itl])
            n_itl += 1
    noted = (n_ttft, n_itl, prompt, generation)
    theirs = (len(ttfts), len(itls), whole.prompt_tokens, whole.generation_tokens)
    if noted != theirs:
        reader.warn_once(
            "IterationStats",
            "update_from_output",
            f"adds values its calls do not account for (first tokens, inter-token latencies, prompt and "
            f"generation tokens: {noted} noted, {theirs} in vLLM's stats): such a step's values are recorded "
            "under the tenant of a request with no facts",
        )
        return None
    return parts
