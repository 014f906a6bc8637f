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
order, each request's tenant from the trace the deep hook keeps on its ``req_stats``. Values the
notes do not account for (a vLLM that computes them otherwise) are recorded under the tenant of a
request with no facts, said once: summed over tenant, each series stays vLLM's.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from otel_llm.integrations.vllm.frontend.traces import TRACE_ATTR, RequestTrace
from otel_llm.integrations.vllm.translation.fields import FieldReader
from otel_llm.integrations.vllm.translation.translate import ITERATION_COUNTS, ITERATION_LATENCIES

# On an IterationStats: [(req_stats, is_prefilling, output)]. Set and read with setattr / getattr,
# never through the instance's __dict__: reading that gives the object a dict of its own, and every
# attribute vLLM then reads on it costs more (a third of what the notes cost).
NOTES_ATTR = "_otel_llm_outputs"
_PARAMETERS = ["self", "output", "engine_core_timestamp", "is_prefilling", "req_stats"]
_EXACT = [*_PARAMETERS, "lora_states", "lora_name"]
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
    one tuple per request output, nothing read). Where vLLM's takes exactly the seven
    parameters of vLLM 0.32-0.34, a wrapper of that signature (half the call's cost)."""

    def note(self: Any, output: Any, is_prefilling: Any, req_stats: Any) -> None:
        try:
            notes = getattr(self, NOTES_ATTR, None)
            if notes is None:
                notes = []
                setattr(self, NOTES_ATTR, notes)
            notes.append((req_stats, is_prefilling, output))
        except Exception as exc:  # noqa: BLE001 - never into vLLM's output processor
            warn_once("noting the tenant of a step's values", exc)

    signature = inspect.signature(original)
    exact = list(signature.parameters) == _EXACT and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in signature.parameters.values()
    )
    if exact:

        def update_from_output_exact(
            self: Any,
            output: Any,
            engine_core_timestamp: Any,
            is_prefilling: Any,
            req_stats: Any,
            lora_states: Any,
            lora_name: Any,
        ) -> Any:
            result = original(self, output, engine_core_timestamp, is_prefilling, req_stats, lora_states, lora_name)
            try:  # the note inlined: one call fewer per output
                notes = getattr(self, NOTES_ATTR, None)
                if notes is None:
                    notes = []
                    setattr(self, NOTES_ATTR, notes)
                notes.append((req_stats, is_prefilling, output))
            except Exception as exc:  # noqa: BLE001 - never into vLLM's output processor
                warn_once("noting the tenant of a step's values", exc)
            return result

        return update_from_output_exact

    def update_from_output(
        self: Any, output: Any, engine_core_timestamp: Any, is_prefilling: Any, req_stats: Any, *args: Any, **kw: Any
    ) -> Any:
        result = original(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kw)
        note(self, output, is_prefilling, req_stats)
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


def split(
    it: Any, reader: FieldReader, tenant_of: Callable[[Optional[RequestTrace]], str], into: dict[str, TenantStep]
) -> None:
    """Add one ``IterationStats``' values to ``into``, by tenant (``tenant_of`` a request's trace,
    None for a request without one): each value to the tenant of the output it was noted with,
    in order; without notes, every value to the tenant of a request with no facts. A value no
    note accounts for (a vLLM that computes them otherwise) goes there too, said once. Once per
    engine step on vLLM's event loop: fields read directly, through the reader only when one is
    gone."""
    try:
        ttfts, itls = it.time_to_first_tokens_iter, it.inter_token_latencies_iter
        prompt, generation = it.num_prompt_tokens, it.num_generation_tokens
    except AttributeError:
        ttfts = reader.sequence(it, _TTFTS.vllm, _TTFTS.metric)
        itls = reader.sequence(it, _ITLS.vllm, _ITLS.metric)
        prompt = int(reader.number(it, _PROMPT.vllm, _PROMPT.metric) or 0)
        generation = int(reader.number(it, _GENERATION.vllm, _GENERATION.metric) or 0)
    notes = getattr(it, NOTES_ATTR, None)
    n_ttft = n_itl = prompt_seen = generation_seen = 0
    try:
        for req_stats, prefilling, output in notes or ():
            trace = getattr(req_stats, TRACE_ATTR, None)
            tenant = trace.tenant if trace is not None else None
            if tenant is None:
                tenant = tenant_of(trace)
            part = into.get(tenant)
            if part is None:
                part = into[tenant] = TenantStep()
            tokens = len(output.new_token_ids)
            part.generation_tokens += tokens
            generation_seen += tokens
            if prefilling:
                part.ttfts.append(ttfts[n_ttft])
                n_ttft += 1
                prefill = output.prefill_stats
                if prefill is not None:
                    count = prefill.num_prompt_tokens
                    part.prompt_tokens += count
                    prompt_seen += count
            else:
                part.itls.append(itls[n_itl])
                n_itl += 1
    except Exception as exc:  # noqa: BLE001 - e.g. a field of vLLM's output gone: the rest is unattributed
        reader.warn_once("IterationStats", "update_from_output", f"notes unreadable ({exc!r}): {_UNATTRIBUTED}")
    if (n_ttft, n_itl, prompt_seen, generation_seen) == (len(ttfts), len(itls), prompt, generation):
        return
    if notes is not None:
        reader.warn_once(
            "IterationStats", "update_from_output", f"adds values its calls do not account for: {_UNATTRIBUTED}"
        )
    rest = into.get(tenant := tenant_of(None)) or into.setdefault(tenant, TenantStep())
    rest.ttfts += ttfts[n_ttft:]
    rest.itls += itls[n_itl:]
    rest.prompt_tokens += max(0, prompt - prompt_seen)
    rest.generation_tokens += max(0, generation - generation_seen)


_UNATTRIBUTED = (
    "the values of such a step that no note accounts for are recorded under the tenant of a request with no "
    "facts (summed over tenant, each series stays vLLM's)"
)
