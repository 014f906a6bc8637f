"""Under vLLM's Python frontend, with a tenant source: each engine step's time to first token,
inter-token latencies and prompt / generation token counts by the tenant of the request each
came from.

vLLM's ``IterationStats`` keeps them as per-step lists and sums that name no request. Its
``update_from_output(output, engine_core_timestamp, is_prefilling, req_stats, ...)``, called by
the output processor once per request output, appends one time to first token when the request
was prefilling, else one inter-token latency, and adds the output's new tokens and, in prefill,
its prompt tokens. Each request arriving is given its tenant's :class:`TenantValues` (its
tenant resolved once) on the trace the deep hook keeps on its ``req_stats``; a wrapper of
``update_from_output`` (:func:`wrapper`, installed by the deep hook only when a tenant source
needs it) adds what each call added to them as it goes, so that nothing per output is left to
pair or sort later: on vLLM's event loop, every Python operation per output token counts.

The stat logger counts each step's times to first token and inter-token latencies as vLLM's
lists have them, and takes the values (:meth:`Tenants.take`) on vLLM's event loop, where the
wrapper adds to them (never from another thread: the wrapper takes no lock), every few steps and
at each step with finished requests, checked against those counts (a vLLM that computes them
otherwise is said once). Where one stat logger records several engines, the values are taken at
each step instead, to go to the engine the step came from, and a step they do not account for
has all of its values recorded under the tenant of a request with no facts. Requests that carry
no values (arrived before they were taken) count under that tenant too.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

from otel_llm.integrations.vllm.frontend.traces import TRACE_ATTR

_PARAMETERS = ["self", "output", "engine_core_timestamp", "is_prefilling", "req_stats"]
_EXACT = [*_PARAMETERS, "lora_states", "lora_name"]


def shape_problem(stats_cls: type) -> Optional[str]:
    """Why the values cannot be taken on this vLLM's ``IterationStats``, or None."""
    method = getattr(stats_cls, "update_from_output", None)
    if method is None:
        return "IterationStats.update_from_output not found"
    parameters = list(inspect.signature(method).parameters)
    if parameters[:5] != _PARAMETERS:
        return f"IterationStats.update_from_output has parameters {parameters}"
    return None


class TenantValues:
    """The values of one tenant's requests since the last :meth:`Tenants.take` (``tenant``
    None: of requests that carry no values, under the tenant of a request with no facts)."""

    __slots__ = ("tenant", "ttfts", "itls", "prompt_tokens", "generation_tokens", "pending", "touched")

    def __init__(self, tenant: Optional[str], touched: list["TenantValues"]) -> None:
        self.tenant = tenant
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.pending = False  # in ``touched``: has values to take
        self.touched = touched

    def add(self, stats: Any, output: Any, is_prefilling: Any) -> None:
        """What one ``update_from_output`` call added to ``stats``."""
        if is_prefilling:
            self.first_token(stats, output)
        else:
            self.itls.append(stats.inter_token_latencies_iter[-1])
        self.generation_tokens += len(output.new_token_ids)
        if not self.pending:
            self.pending = True
            self.touched.append(self)

    def first_token(self, stats: Any, output: Any) -> None:
        self.ttfts.append(stats.time_to_first_tokens_iter[-1])
        prefill = output.prefill_stats
        if prefill is not None:
            self.prompt_tokens += prefill.num_prompt_tokens


# One step's values by tenant: (tenant, ttfts, itls, prompt tokens, generation tokens); tenant
# None: those of requests that carry no values.
Taken = list[tuple[Optional[str], Sequence[float], Sequence[float], int, int]]
# What a step carries when nothing is taken at it (its values are taken with a later step's).
NOTHING: Taken = []


class Tenants:
    """Every tenant's values in this process (as many as the resolver gives labels: bounded),
    what gives a request's tenant facts their label (the telemetry's resolver), and how many
    times to first token and inter-token latencies vLLM's steps had since the last take
    (``expected_*``, counted by the stat logger: what the values taken must account for)."""

    def __init__(self, resolve: Callable[[Optional[dict]], str]) -> None:
        self.resolve = resolve
        self.touched: list[TenantValues] = []  # those with values, in the order they got them
        self.values: dict[str, TenantValues] = {}
        self.no_values = TenantValues(None, self.touched)
        self.expected_ttfts = 0
        self.expected_itls = 0
        self.steps = 0  # steps since the last take

    def values_for(self, facts: Optional[dict]) -> TenantValues:
        """The values a request with these facts adds to (at its arrival)."""
        tenant = self.resolve(facts)
        values = self.values.get(tenant)
        if values is None:
            values = self.values[tenant] = TenantValues(tenant, self.touched)
        return values

    def take(self) -> tuple[Taken, bool]:
        """The values added since the last take, by tenant, and whether they account for the
        times to first token and inter-token latencies vLLM's steps had meanwhile."""
        taken: Taken = []
        ttfts = itls = 0
        for values in self.touched:
            taken.append((values.tenant, values.ttfts, values.itls, values.prompt_tokens, values.generation_tokens))
            ttfts += len(values.ttfts)
            itls += len(values.itls)
            values.ttfts = []
            values.itls = []
            values.prompt_tokens = values.generation_tokens = 0
            values.pending = False
        self.touched.clear()
        accounted = (ttfts, itls) == (self.expected_ttfts, self.expected_itls)
        self.expected_ttfts = self.expected_itls = self.steps = 0
        return taken, accounted


UNACCOUNTED = (
    "adds values its calls do not account for: the per-tenant time to first token, inter-token latency and "
    "token counters may not sum to vLLM's"
)
UNATTRIBUTED = (
    "adds values its calls do not account for: the values of such a step are recorded under the tenant of a "
    "request with no facts (summed over tenant, each series stays vLLM's)"
)


def wrapper(original: Callable) -> Callable:
    """``IterationStats.update_from_output``, adding what each call added to the values of its
    request's tenant (the hot path: once per request output). Where vLLM's takes exactly the
    seven parameters of vLLM 0.32-0.34, a wrapper of that signature (no argument packing)."""
    trace_attr = TRACE_ATTR

    def add(self: Any, output: Any, is_prefilling: Any, req_stats: Any) -> None:
        try:
            values = getattr(req_stats, trace_attr).values
            values.add(self, output, is_prefilling)
        except AttributeError:  # no trace, or no values on it
            _add_without_values(self, output, is_prefilling)

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
            try:  # TenantValues.add inlined: one call fewer per output
                values = req_stats._otel_llm_trace.values  # TRACE_ATTR
                if is_prefilling:
                    values.first_token(self, output)
                else:
                    values.itls.append(self.inter_token_latencies_iter[-1])
                values.generation_tokens += len(output.new_token_ids)
                if not values.pending:
                    values.pending = True
                    values.touched.append(values)
            except AttributeError:  # no trace, or no values on it
                _add_without_values(self, output, is_prefilling)
            return result

        return update_from_output_exact

    def update_from_output(
        self: Any, output: Any, engine_core_timestamp: Any, is_prefilling: Any, req_stats: Any, *args: Any, **kw: Any
    ) -> Any:
        result = original(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kw)
        add(self, output, is_prefilling, req_stats)
        return result

    return update_from_output


def _add_without_values(stats: Any, output: Any, is_prefilling: Any) -> None:
    """An output of a request that carries no values (it arrived before they were taken)."""
    try:
        if current is not None:
            current.no_values.add(stats, output, is_prefilling)
    except Exception:  # noqa: BLE001 - never into vLLM's output processor: the step's check tells
        pass


# The values requests arriving now add to (the deep hook's; None: the values are not taken).
current: Optional[Tenants] = None
