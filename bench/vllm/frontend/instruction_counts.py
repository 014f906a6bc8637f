"""Instructions per output token: each variant's round in a process of its own under callgrind."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ... import instructions
from ...common import ratio
from . import ROOT, TARGET, TARGET_REPLACE
from .frontend import VARIANTS, serving
from .scripted_core import round_specs

COUNT_TIMEOUT_S = 3600  # one counted round under callgrind: a few minutes


async def count_round(variant: str, requests: int, tokens: int, running: int, loads: int, tenants: int = 0) -> None:
    """A warm-up round, then one counted (run under callgrind by :func:`run_instructions`; the
    round itself checks that every token was streamed)."""
    window = instructions.Window()
    if not window.under_callgrind():
        raise RuntimeError("--count-round runs under callgrind: use --instructions")
    # Under callgrind a round takes a minute, not a second: timers that would not fire within a
    # round (the span processor's 5 s, vLLM's stats log every 10 s) would fire many times.
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
    os.environ["VLLM_LOG_STATS_INTERVAL"] = "600"
    specs = round_specs(requests, tokens, running)
    async with serving(loads, tenants) as (frontend, client):
        await frontend.round(variant, specs, client)
        await frontend.round(variant, specs, client, measure=window)


def _counted(
    name: str, variant: str, requests: int, tokens: int, running: int, loads: int, tenants: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-callgrind-{name}-") as tmp:
        out = Path(tmp)
        argv = [
            "--count-round",
            variant,
            "--requests",
            str(requests),
            "--tokens",
            str(tokens),
            "--running",
            str(running),
            "--loads",
            str(loads),
            "--tenants",
            str(tenants),
        ]
        with open(out / "stderr.log", "wb") as err:
            proc = subprocess.run(
                [*instructions.command(out), sys.executable, "-m", "bench.vllm.frontend", *argv],
                cwd=str(ROOT),
                stdout=subprocess.DEVNULL,
                stderr=err,
                timeout=COUNT_TIMEOUT_S,
            )
        if proc.returncode != 0:
            tail = (out / "stderr.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name}: the counted round failed ({proc.returncode}):\n{tail}")
        by_thread = instructions.totals_by_thread(out)
    output_tokens = requests * tokens * loads
    total, loop = sum(by_thread.values()), by_thread.get(1, 0)
    return {
        "per_token": total / output_tokens,
        "loop_per_token": loop / output_tokens,
        "others_per_token": (total - loop) / output_tokens,
        "by_thread": {str(k): v for k, v in sorted(by_thread.items())},
    }


def run_instructions(
    requests: int,
    tokens: int,
    running: int,
    loads: int,
    jobs: int,
    variants: Sequence[str] = VARIANTS,
    log: Any = sys.stderr,
    tenants: int = 0,
) -> dict[str, Any]:
    reason = instructions.missing()
    if reason:
        raise SystemExit(f"--instructions: {reason}")
    # stock twice: how far two counts of the same work lie apart.
    runs = [(n, n) for n in ("stock", *(v for v in variants if v != "stock"))] + [("stock_again", "stock")]
    print(
        f"[vllm_frontend] instructions: {len(runs)} rounds under callgrind, {jobs} at a time (a few minutes each) ...",
        file=log,
        flush=True,
    )
    counted: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(_counted, n, v, requests, tokens, running, loads, tenants): n for n, v in runs}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            counted[name] = future.result()
            print(f"[vllm_frontend]   {name}: {counted[name]['per_token']:,.0f} per token", file=log, flush=True)
    counted = {n: counted[n] for n, _ in runs}
    stock = counted["stock"]
    return {
        "method": "instructions (valgrind callgrind) of the API-server process over one round per variant, each "
        "in a process of its own after a warm-up round; every thread, the event loop's (valgrind's thread 1) "
        "apart; span processor and stats-log timers held off (a round under callgrind lasts a minute)",
        "load": {
            "requests": requests,
            "tokens_per_request": tokens,
            "loads_per_round": loads,
            "output_tokens": requests * tokens * loads,
            "tenants": tenants,
        },
        "instructions": counted,
        "over_stock": {n: ratio(c["per_token"], stock["per_token"]) for n, c in counted.items()},
        "loop_over_stock": {n: ratio(c["loop_per_token"], stock["loop_per_token"]) for n, c in counted.items()},
        "targets": {"otlp_over_stock": TARGET, "replace_over_stock": TARGET_REPLACE},
    }


def instruction_table_lines(r: dict[str, Any]) -> list[str]:
    if "instructions" not in r:
        return []
    lines = [
        f"8b. vLLM's API server, scripted engine core, instructions per output token ({r['load']['output_tokens']} "
        "tokens, callgrind)",
        "   variant       per token  ratio  loop thread ratio",
    ]
    for name, c in r["instructions"].items():
        lines.append(
            f"   {name:<12} {c['per_token']:10,.0f}  {r['over_stock'][name]:.4f}  {r['loop_over_stock'][name]:.4f}"
        )
    return lines
