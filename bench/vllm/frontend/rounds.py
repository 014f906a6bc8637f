"""The timed rounds: every variant interleaved round by round, then scraped and profiled; their
summary and table."""

from __future__ import annotations

import asyncio
import statistics
import sys
from typing import Any, Sequence

from ...common import median, ratio
from . import TARGET, TARGET_REPLACE
from .client import SCRAPE_INTERVAL_S
from .frontend import TENANT_VARIANTS, VARIANTS, serving
from .profile import Profile
from .scripted_core import round_specs

# Loads per round: about 4.5 s of serving on these machines, within the 5 s export interval of
# the setting measured, so that the otlp variants' one metrics export per round is one per 5 s.
LOADS = 14
PROFILE_ROUNDS = 3  # per profiled variant


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 4:
        return [min(values), max(values)]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def summarize(rounds: dict[str, list[dict[str, Any]]], field: str) -> dict[str, Any]:
    base = rounds["stock"]
    out: dict[str, Any] = {}
    for name, rs in rounds.items():
        paired = [r[field] / b[field] for r, b in zip(rs, base)]
        out[name] = {
            "median": median([r[field] for r in rs]),
            "over_stock": ratio(median([r[field] for r in rs]), median([b[field] for b in base])),
            "over_stock_paired_median": median(paired),
            "over_stock_paired_quartiles": _quartiles(paired),
            "over_stock_paired_range": [min(paired), max(paired)],
        }
    return out


async def _run(
    rounds: int,
    requests: int,
    tokens: int,
    running: int,
    loads: int,
    variants: Sequence[str],
    profile: bool,
    log: Any,
    tenants: int,
) -> dict[str, Any]:
    specs = round_specs(requests, tokens, running)
    variants = ("stock", *(v for v in (*VARIANTS, *TENANT_VARIANTS) if v in variants and v != "stock"))
    async with serving(loads, tenants) as (frontend, client):
        for name in variants:  # warm-up, not counted
            await frontend.round(name, specs, client)
        print(f"[vllm_frontend] {rounds} rounds of {len(variants)} variants ...", file=log, flush=True)
        results: dict[str, list[dict[str, Any]]] = {n: [] for n in variants}
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for name in order:
                results[name].append(await frontend.round(name, specs, client))
            print(f"[vllm_frontend]   round {r + 1}/{rounds}", file=log, flush=True)
        compared = [v for v in ("stock", "otlp", "replace", *TENANT_VARIANTS) if v in variants]  # scraped, profiled
        scraped: dict[str, Any] = {}
        for name in compared:
            pair = [await frontend.round(name, specs, client, scrape=s) for s in (False, True, False, True)]
            scraped[name] = {
                "max_gap_ms": {
                    "quiet": [p["max_gap_ms"] for p in pair[::2]],
                    "scraped": [p["max_gap_ms"] for p in pair[1::2]],
                },
                "p99_gap_ms": {
                    "quiet": [p["p99_gap_ms"] for p in pair[::2]],
                    "scraped": [p["p99_gap_ms"] for p in pair[1::2]],
                },
                "tokens_per_s": {
                    "quiet": [p["tokens_per_s"] for p in pair[::2]],
                    "scraped": [p["tokens_per_s"] for p in pair[1::2]],
                },
                "scrapes": [p["scrapes"] for p in pair[1::2]],
                "scrape_ms_median": [p["scrape_ms_median"] for p in pair[1::2]],
            }
        profiles: dict[str, Any] = {}
        if profile:
            for name in compared:
                profiler = Profile()
                for _ in range(PROFILE_ROUNDS):
                    await frontend.round(name, specs, client, measure=profiler)
                profiles[name] = profiler.report()
    return {
        "method": "vLLM's real API server (OpenAI completions, streaming, uvicorn; AsyncLLM, OutputProcessor, "
        "StatLoggerManager) in this process, a scripted engine core in place of the engine-core process (lockstep: "
        "one SSE chunk per token), the client in another process; a round per variant, variants interleaved (order "
        "rotated); a round serves its loads one after the other and ends with the plugin's flush (its spans, one "
        "metrics export); CPU = time.process_time over the round (every thread) incl. the flush, "
        "main = the event loop's thread (time.thread_time)",
        "load": {
            "requests": requests,
            "tokens_per_request": tokens,
            "loads_per_round": loads,
            "output_tokens": requests * tokens * loads,
            "rounds": rounds,
            **({"tenants": tenants} if tenants else {}),
        },
        "cpu_per_token": summarize(results, "cpu_us_per_token"),
        "main_thread_per_token": summarize(results, "main_us_per_token"),
        "other_threads_us_per_token": {n: median([r["other_us_per_token"] for r in rs]) for n, rs in results.items()},
        "targets": {"otlp_over_stock": TARGET, "replace_over_stock": TARGET_REPLACE},
        "scrape_while_busy": scraped,
        "profile": profiles,
        "rounds": results,
    }


def run(
    rounds: int = 20,
    requests: int = 64,
    tokens: int = 96,
    running: int = 4,
    loads: int = LOADS,
    variants: Sequence[str] = VARIANTS,
    profile: bool = True,
    log: Any = sys.stderr,
    tenants: int = 0,
) -> dict[str, Any]:
    """``tenants``: every variant's requests carry priorities 0..N-1 (:class:`.frontend.Frontend`)."""
    return asyncio.run(_run(rounds, requests, tokens, running, loads, variants, profile, log, tenants))


def table_lines(r: dict[str, Any]) -> list[str]:
    if "cpu_per_token" not in r:
        return []
    load = r["load"]
    lines = [
        f"8. vLLM's API server, scripted engine core ({load['rounds']} rounds x {load['output_tokens']} tokens): "
        "CPU per output token / stock",
        "   variant     us/token  ratio  paired [quartiles]        main-thread ratio",
    ]
    for name, s in r["cpu_per_token"].items():
        m = r["main_thread_per_token"][name]
        q = s["over_stock_paired_quartiles"]
        lines.append(
            f"   {name:<10} {s['median']:8.1f}  {s['over_stock']:.3f}  {s['over_stock_paired_median']:.3f} "
            f"[{q[0]:.3f}, {q[-1]:.3f}]   {m['over_stock']:.3f}"
        )
    for name, s in r.get("scrape_while_busy", {}).items():
        lines.append(
            f"   scrape every {SCRAPE_INTERVAL_S * 1000:.0f} ms, {name}: gap between chunks, max (p99) quiet "
            f"{max(s['max_gap_ms']['quiet']):.1f} ({max(s['p99_gap_ms']['quiet']):.2f}) ms, scraped "
            f"{max(s['max_gap_ms']['scraped']):.1f} ({max(s['p99_gap_ms']['scraped']):.2f}) ms"
        )
    return lines
