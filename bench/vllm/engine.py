"""``python -m bench.vllm.engine [--pairs N] [--tenants N [--against plugin]] [--out PATH]`` (in .venv-vllm-cpu)

What the plugin costs vLLM's real CPU engine: output tokens/s and the API server's CPU seconds
with the plugin and without, both with vLLM's own Prometheus logger (always on). Two servers
run side by side, one after the other started: "off" with vLLM's ``VLLM_PLUGINS`` naming every
plugin installed except ours, so vLLM never loads an otel-llm entry point (checked: its plugin
port does not answer); "on" with the plugin as a deployment would run it (deep hook, our
/metrics, metrics and one span per request pushed over OTLP/HTTP every 5 s to a receiver in this
process). CPU is read from each process's CPU clock (nanoseconds, exited threads included; the
ticks of /proc/<pid>/stat are 10 ms, 2% of a load's API-server CPU), the event loop's thread
(vLLM's main thread) apart from the others. The same seeded
load then runs on each in turn (off, on, off, on, ...), never both at once; pair i uses seed i
on both. Both servers are started again for each block of pairs (``--blocks``): one server
process runs a few percent faster or slower than another of the same settings, for as long as
it lives (seen here: the same "off" settings 82 and 85 us of API-server CPU per token in two
starts), which pairing within one start cannot average out. The result goes into
bench/results.json under ``vllm_engine``; other keys are kept.

``--tenants N``: both servers schedule by priority (``--scheduling-policy priority``), every load
has N priority classes, and "on" has ``OTEL_LLM_TENANT=priority``; the result goes under
``vllm_engine_tenants`` (``vllm_engine_replace_tenants`` with ``--metrics-mode replace``). With
``--against plugin`` as well, "off" is the same plugin without a tenant source: what tenants
alone add (key suffix ``_vs_plugin``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Optional, Sequence

from ..common import median, ratio, write_section

RESULTS = Path(__file__).resolve().parents[1] / "results.json"
KEY = "vllm_engine"
REPLACE_KEY = "vllm_engine_replace"  # the same with OTEL_LLM_VLLM_METRICS=replace on the "on" server
TENANTS_SUFFIX = "_tenants"  # --tenants N: priority classes, the "on" server with OTEL_LLM_TENANT=priority
AGAINST_PLUGIN_SUFFIX = "_vs_plugin"  # --against plugin: "off" is the plugin without a tenant source
PLUGIN_GROUPS = (
    "vllm.general_plugins",
    "vllm.stat_logger_plugins",
    "vllm.platform_plugins",
    "vllm.io_processor_plugins",
)
TARGET_TOKENS_PER_S = 0.99  # on / off
TARGET_CPU = 1.05  # on / off, API-server CPU per output token
TARGET_CPU_REPLACE = 1.00  # the same in replace mode, where vLLM's own logger is not built
EXPORT_INTERVAL_MS = 5000  # metrics and spans pushed every 5 s


def plugins_without_ours() -> str:
    """``VLLM_PLUGINS`` for a server without otel-llm: every installed vLLM plugin but ours.

    vLLM's ``load_plugins_by_group`` loads only the entry points named there (in every group,
    ``vllm.stat_logger_plugins`` included); an empty value loads none."""
    names = {
        ep.name for group in PLUGIN_GROUPS for ep in entry_points(group=group) if not ep.value.startswith("otel_llm")
    }
    return ",".join(sorted(names))


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads, exited ones included): its CPU clock,
    the id ``clock_getcpuclockid(pid)`` returns (Linux: ``~pid << 3 | CPUCLOCK_SCHED``)."""
    return time.clock_gettime((~pid << 3) | 2)


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of the main thread of ``pid`` (the event loop of vLLM's API server):
    the first field of its schedstat, nanoseconds on the CPU."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (vLLM's engine core and anything it starts)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def engine_cpu_seconds(pid: int) -> float:
    return sum(cpu_seconds(child) for child in descendants(pid))


def answers(url: str) -> bool:
    from otel_llm.testing.vllm.server import ServerFailed, scrape

    try:
        scrape(url, timeout=10.0)
    except ServerFailed:
        return False
    return True


def preemptions(url: str) -> float:
    """vLLM's ``num_preemptions_total`` on the server at ``url``, summed over its labels."""
    from otel_llm.testing.vllm.server import scrape

    return sum(v for (name, _), v in scrape(url + "/metrics").items() if name == "vllm:num_preemptions_total")


def plugin_env(endpoint: str, metrics_mode: str, export_interval_ms: int = EXPORT_INTERVAL_MS) -> dict[str, str]:
    """The plugin as deployed: deep hook, our /metrics, metrics and spans over OTLP/HTTP to ``endpoint``."""
    return {
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        "OTEL_METRICS_EXPORTER": "otlp,prometheus",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRIC_EXPORT_INTERVAL": str(export_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": str(export_interval_ms),
        "OTEL_LLM_VLLM_METRICS": metrics_mode,
    }


def run_round(server: Any, load: Any) -> dict[str, Any]:
    """One load on one server: tokens/s, the API server's and the engine's CPU seconds, preemptions."""
    from otel_llm.testing.vllm.server import run_load

    pid = server.proc.pid
    load_average = os.getloadavg()[0]  # the machine is shared: how busy it was when the round began
    preempted = preemptions(server.url)
    api0, loop0, engine0 = cpu_seconds(pid), main_thread_cpu_seconds(pid), engine_cpu_seconds(pid)
    start = time.monotonic()
    completions = run_load(server.url, load)
    seconds = time.monotonic() - start
    api_cpu, engine_cpu = cpu_seconds(pid) - api0, engine_cpu_seconds(pid) - engine0
    loop_cpu = main_thread_cpu_seconds(pid) - loop0
    failed = [c for c in completions if c.status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    tokens = sum(c.completion_tokens for c in completions)
    preempted = preemptions(server.url) - preempted
    return {
        "seed": load.seed,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "api_server_cpu_s": api_cpu,
        "engine_cpu_s": engine_cpu,
        "api_server_cpu_ms_per_token": 1000 * api_cpu / tokens,
        "event_loop_cpu_ms_per_token": 1000 * loop_cpu / tokens,
        "other_threads_cpu_ms_per_token": 1000 * (api_cpu - loop_cpu) / tokens,
        "preemptions": int(preempted),
        "load_average_1m": load_average,
    }


def run(
    pairs: int = 12,
    requests: int = 64,
    max_tokens: int = 96,
    metrics_mode: str = "add",
    blocks: int = 3,
    tenants: int = 0,
    against_plugin: bool = False,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    from otel_llm.testing.models import make_tiny_llama
    from otel_llm.testing.span_receiver import SpanReceiver
    from otel_llm.testing.vllm.server import SERVER_ARGS, Load, VllmServer

    without = plugins_without_ours()
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    block_of_pair: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp, SpanReceiver() as receiver:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        plugin = plugin_env(receiver.http_endpoint, metrics_mode)
        env = {
            "off": plugin if against_plugin else {"VLLM_PLUGINS": without},
            "on": {**plugin, "OTEL_LLM_TENANT": "priority"} if tenants else plugin,
        }
        server_args = ("--scheduling-policy", "priority") if tenants else ()
        pair = 0
        for block in range(blocks):
            servers = {
                name: VllmServer(model, args=server_args, env=e, log_path=Path(tmp) / f"{name}-{block}.log")
                for name, e in env.items()
            }
            try:
                for name, server in servers.items():
                    print(f"[vllm_engine] block {block + 1}/{blocks}: starting vLLM {name} ...", file=log, flush=True)
                    t0 = time.monotonic()
                    server.start()
                    print(f"[vllm_engine] vLLM {name} ready in {time.monotonic() - t0:.0f} s", file=log, flush=True)
                plugin_answers = {name: answers(s.metrics_url) for name, s in servers.items()}
                if plugin_answers != {"off": against_plugin, "on": True}:
                    expected = "on and off" if against_plugin else "on only"
                    raise RuntimeError(f"the plugin's endpoint answers {plugin_answers}: expected {expected}")
                for server in servers.values():  # warm-up, not counted
                    warm_up = Load(
                        requests=requests, concurrency=requests, max_tokens=max_tokens, seed=1000, priorities=tenants
                    )
                    run_round(server, warm_up)
                for _ in range(pairs // blocks + (block < pairs % blocks)):
                    pair += 1
                    block_of_pair.append(block)
                    load = Load(
                        requests=requests, concurrency=requests, max_tokens=max_tokens, seed=pair, priorities=tenants
                    )
                    for name in ("off", "on"):
                        rounds[name].append(run_round(servers[name], load))
                        r = rounds[name][-1]
                        print(
                            f"[vllm_engine] pair {pair} {name:>3}: {r['tokens_per_s']:.0f} tokens/s, API server "
                            f"{r['api_server_cpu_ms_per_token']:.4f} ms CPU/token (event loop "
                            f"{r['event_loop_cpu_ms_per_token']:.4f}), {r['preemptions']} preemptions",
                            file=log,
                            flush=True,
                        )
            finally:
                for server in servers.values():
                    server.stop()
        spans_expected = (pairs + blocks) * requests * (2 if against_plugin else 1)
        spans_received = receiver.wait_for(lambda r: len(r.named("llm_request")) >= spans_expected, 60.0)

    def med(name: str, key: str) -> float:
        return median([r[key] for r in rounds[name]])

    pair_ratios = [ratio(on["tokens_per_s"], off["tokens_per_s"]) for off, on in zip(rounds["off"], rounds["on"])]
    cpu_ratios = [
        ratio(on["api_server_cpu_ms_per_token"], off["api_server_cpu_ms_per_token"])
        for off, on in zip(rounds["off"], rounds["on"])
    ]
    tokens_ratio = ratio(med("on", "tokens_per_s"), med("off", "tokens_per_s"))
    cpu_ratio = ratio(med("on", "api_server_cpu_ms_per_token"), med("off", "api_server_cpu_ms_per_token"))
    # Tenants against the same plugin have no target of their own: within a server start's spread.
    target_cpu = None if against_plugin else TARGET_CPU_REPLACE if metrics_mode == "replace" else TARGET_CPU
    targets = {f"tokens/s on/off >= {TARGET_TOKENS_PER_S}": tokens_ratio >= TARGET_TOKENS_PER_S}
    if target_cpu is not None:
        targets[f"API-server CPU on/off <= {target_cpu:.2f}"] = cpu_ratio <= target_cpu
    cpu_by_block = [
        ratio(
            median([r["api_server_cpu_ms_per_token"] for r, b in zip(rounds["on"], block_of_pair) if b == block]),
            median([r["api_server_cpu_ms_per_token"] for r, b in zip(rounds["off"], block_of_pair) if b == block]),
        )
        for block in range(blocks)
    ]
    return {
        "method": "two vLLM OpenAI servers (vllm-cpu, tiny Llama, KV pressure) started again for each block of "
        "pairs; the same seeded load alternately on each (off, on, off, on, ...), never concurrently; pair i uses "
        "seed i on both; one warm-up load each per block. CPU: the API-server process's CPU clock "
        "(clock_getcpuclockid) before and after each load, its main thread (the event loop) from "
        "/proc/<pid>/task/<pid>/schedstat; engine_cpu_s: its child processes (the engine core).",
        "server_args": [*SERVER_ARGS, *server_args],
        "load": {
            "requests": requests,
            "concurrency": requests,
            "max_tokens": max_tokens,
            "pairs": pairs,
            "blocks": blocks,
            "priority_classes": tenants,  # request i asks for priority i % tenants; 0: none
        },
        "off": {
            **({"plugin": "the same as on, without OTEL_LLM_TENANT"} if against_plugin else {"VLLM_PLUGINS": without}),
            "plugin_endpoint_answers": plugin_answers["off"],
        },
        "on": {
            "plugin": "entry points otel_llm + otel_llm_deep_hook; OTEL_LLM_VLLM_DEEP_HOOK=1; our /metrics; "
            f"metrics and one span per request over OTLP/HTTP every {EXPORT_INTERVAL_MS / 1000:g} s to a "
            "receiver in the bench process",
            "metric_exports_received": receiver.metric_exports,
            "OTEL_LLM_VLLM_METRICS": metrics_mode,
            "OTEL_LLM_TENANT": "priority" if tenants else None,
            "plugin_endpoint_answers": plugin_answers["on"],
            "spans_received_all": spans_received,
        },
        "tokens_per_s": {"off": med("off", "tokens_per_s"), "on": med("on", "tokens_per_s")},
        "tokens_per_s_ratio_of_medians": tokens_ratio,
        "tokens_per_s_ratio_by_pair": pair_ratios,
        "tokens_per_s_ratio_paired_median": median(pair_ratios),
        "api_server_cpu_ms_per_token": {
            "off": med("off", "api_server_cpu_ms_per_token"),
            "on": med("on", "api_server_cpu_ms_per_token"),
        },
        "api_server_cpu_ratio_by_pair": cpu_ratios,
        "api_server_cpu_ratio_paired_median": median(cpu_ratios),
        "api_server_cpu_ratio_of_medians": cpu_ratio,
        "api_server_cpu_ratio_by_block": cpu_by_block,
        "event_loop_cpu_ms_per_token": {
            "off": med("off", "event_loop_cpu_ms_per_token"),
            "on": med("on", "event_loop_cpu_ms_per_token"),
        },
        "event_loop_cpu_ratio_of_medians": ratio(
            med("on", "event_loop_cpu_ms_per_token"), med("off", "event_loop_cpu_ms_per_token")
        ),
        "other_threads_cpu_ms_per_token": {
            "off": med("off", "other_threads_cpu_ms_per_token"),
            "on": med("on", "other_threads_cpu_ms_per_token"),
        },
        "engine_cpu_s": {"off": med("off", "engine_cpu_s"), "on": med("on", "engine_cpu_s")},
        "rounds": rounds,
        "targets": targets,
    }


def table_lines(r: dict[str, Any]) -> list[str]:
    if "tokens_per_s" not in r:
        return [f"vllm_engine: ERROR {r.get('error')}"] if "error" in r else []
    tps, cpu = r["tokens_per_s"], r["api_server_cpu_ms_per_token"]
    loop, others = r.get("event_loop_cpu_ms_per_token"), r.get("other_threads_cpu_ms_per_token")
    split = (
        [
            f"   of which the event loop  off {loop['off']:.4f}  on {loop['on']:.4f} ms/token  "
            f"ratio {r['event_loop_cpu_ratio_of_medians']:.3f}; other threads off {others['off']:.4f}  "
            f"on {others['on']:.4f}"
        ]
        if loop is not None and others is not None
        else []  # results from before the split
    )
    classes = f", {r['load']['priority_classes']} priority classes" if r["load"].get("priority_classes") else ""
    compared = "tenants on / off (the plugin in both)" if "plugin" in r["off"] else "plugin on / off"
    return [
        f"5. vLLM's real CPU engine, {compared} ({r['load']['pairs']} pairs of {r['load']['requests']} "
        f"requests{classes})",
        f"   tokens/s        off {tps['off']:.0f}  on {tps['on']:.0f}  ratio of medians "
        f"{r['tokens_per_s_ratio_of_medians']:.3f}  paired median {r['tokens_per_s_ratio_paired_median']:.3f}",
        "   by pair         " + "  ".join(f"{x:.3f}" for x in r["tokens_per_s_ratio_by_pair"]),
        f"   API server CPU  off {cpu['off']:.3f}  on {cpu['on']:.3f} ms/token  "
        f"ratio of medians {r['api_server_cpu_ratio_of_medians']:.3f}  "
        f"paired median {r['api_server_cpu_ratio_paired_median']:.3f}",
        "   by block (server starts) " + "  ".join(f"{x:.3f}" for x in r["api_server_cpu_ratio_by_block"]),
        *split,
        "   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in r["targets"].items()),
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.engine", description=__doc__.splitlines()[2])
    p.add_argument("--pairs", type=int, default=12, help="off/on pairs of loads (default 12, at least 3)")
    p.add_argument(
        "--blocks", type=int, default=3, help="server starts per side, the pairs shared among them (default 3)"
    )
    p.add_argument("--requests", type=int, default=64, help="requests per load, all at once (default 64)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--metrics-mode",
        choices=("add", "replace"),
        default="add",
        help=f"OTEL_LLM_VLLM_METRICS of the plugin's server (default add, beside vLLM's logger; replace, the "
        f"plugin's own default: written under {REPLACE_KEY})",
    )
    p.add_argument(
        "--tenants",
        type=int,
        default=0,
        help=f"N priority classes on both servers, the plugin's with OTEL_LLM_TENANT=priority (key + {TENANTS_SUFFIX})",
    )
    p.add_argument(
        "--against",
        choices=("stock", "plugin"),
        default="stock",
        help=f"with --tenants, plugin: off is the plugin without a tenant source (key + {AGAINST_PLUGIN_SUFFIX})",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON to update (key {KEY})")
    args = p.parse_args(argv)
    if args.pairs < 3:
        p.error("--pairs: at least 3")
    if not 1 <= args.blocks <= args.pairs:
        p.error("--blocks: from 1 to --pairs")
    if args.tenants < 0:
        p.error("--tenants: 0 or more")
    against_plugin = args.against == "plugin"
    if against_plugin and not args.tenants:
        p.error("--against plugin: with --tenants N")
    key = (
        (KEY if args.metrics_mode == "add" else REPLACE_KEY)
        + (TENANTS_SUFFIX if args.tenants else "")
        + (AGAINST_PLUGIN_SUFFIX if against_plugin else "")
    )
    return write_section(
        key,
        args.out,
        lambda: run(
            args.pairs, args.requests, args.max_tokens, args.metrics_mode, args.blocks, args.tenants, against_plugin
        ),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
