"""``python -m bench.vllm.stream [--loads N] [--reps N] [--evict MIB ...] [--steps-per-read K ...]
[--against REV] [--tree NAME=DIR ...] [--profile] [--out PATH]`` (in .venv-vllm-cpu or .venv-vllm)

What the consumer of vLLM's engine-core stream costs ``vllm serve``'s process per engine step
under the Rust frontend (:mod:`otel_llm.integrations.vllm.frontend.stream_consumer`), without a server.

The stream is built with vLLM's own classes and encoder (``EngineCoreOutputs`` encoded by
``MsgpackEncoder``, framed as the engine core's tap frames it) by a small model of vLLM's
scheduler under ``bench.vllm.rust``'s load: 64 requests × 96 tokens sent at once, prompts of 8–64
tokens with a traceparent each, 12 KV blocks of 32 tokens, so 3–4 requests run per step, each
with one new token, and the last one scheduled is preempted (recompute) when a block runs out;
each preemption's cause record goes over the cause channel before the step's output, as the deep
hook sends it.

Before each engine step the bench copies ``--evict`` MiB: the engine's own work between two
outputs, as the CPU caches see it (on the real engine the consumer wakes once per step, its code
and data evicted meanwhile; 16 MiB gives about what ``bench.vllm.rust`` measured, 0 is the warm
floor). It writes what the tap would write into one end of a socket pair and times the consumer
reading it from the other end, as its thread would: ``select`` on its sockets (``loop``), then its
``_read`` (``consumer``: recv, frames, causes drained, decode, translation, the telemetry on the
providers ``setup_telemetry`` builds from ``bench.vllm.rust``'s ``otel`` settings: Prometheus
reader, one span per request through the batch span processor and OTLP/HTTP to a receiver in
this process). ``--steps-per-read K``: K steps written before each read, as for a consumer that
reads every K engine steps. After each repetition the spans are flushed and that export is timed
(``span_export``).

Variants, interleaved a slice of steps at a time on the same stream, the order rotated: ``ours``,
this tree's ``otel_llm``; ``--against REV``: ``base``, ``otel_llm`` as of a git revision (``git
archive``); ``--tree NAME=DIR``: the ``otel_llm`` in DIR (a copy with a change to try). Each is
imported as a package of its own (``otel_llm_<name>``, its imports renamed), each at every
``--steps-per-read`` (``NAME@K`` when several). Their /metrics must agree. ``--profile`` adds a
cProfile of this tree's consumer. The result goes into bench/results.json under ``vllm_stream``;
other keys are kept.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import math
import os
import pstats
import random
import re
import select
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from otel_llm.testing.vllm.stream import Shape

from ..common import median, ratio, write_section

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
KEY = "vllm_stream"
SLICE = 24  # steps: the interleaving's grain (a multiple of the usual steps per read)
STEP_S = 0.002  # engine clock per step: bench.vllm.rust's real engine steps about every 2 ms

# bench.vllm.rust's load and engine arguments (otel_llm.testing.vllm.server: Load, KV_PRESSURE_ARGS)
REQUESTS, MAX_TOKENS = 64, 96
SHAPE = Shape(max_num_seqs=16, kv_blocks=12, block_size=32, prompt=(8, 64), max_tokens=(96, 96), step_s=STEP_S)

# The otel server's settings in bench.vllm.rust, the span processor's timer out of the way: the
# spans leave when the repetition's flush is timed.
ENV = {
    "OTEL_SERVICE_NAME": "bench-vllm-stream",
    "OTEL_LLM_VLLM_DEEP_HOOK": "1",
    "OTEL_METRICS_EXPORTER": "prometheus",
    "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "3600000",
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "65536",
}


@dataclass
class Step:
    """What the engine core's tap sends after one step, and the cause records sent before it."""

    data: bytes
    causes: list[Any] = field(default_factory=list)
    tokens: int = 0
    outputs: int = 0


class Stream:
    """The engine core's side: seeded loads played through a model of vLLM's scheduler."""

    def __init__(self, loads: int, seed: int = 0) -> None:
        from otel_llm.integrations.vllm.channels import stream_channel
        from otel_llm.testing.vllm.stream import SchedulerModel

        self.steps: list[Step] = []
        self.load_starts: list[int] = []
        # The engine's clock: its loads over before they are played.
        self.model = SchedulerModel(SHAPE, time.monotonic() - 10.0 * loads, time.time() - time.monotonic())
        self._hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny-llama"})
        for load in range(loads):
            self.load_starts.append(len(self.steps))
            for step in self.model.load(random.Random(seed + load), REQUESTS, f"{load}-"):
                self._step(step)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    def _step(self, step: Any) -> None:
        from vllm.v1.serial_utils import MsgpackEncoder

        from otel_llm.integrations.vllm.channels import stream_channel

        data = stream_channel.outputs_frame(MsgpackEncoder().encode(step.outputs))
        if step.given:
            rows = [
                [r.request_id, r.arrival_time, len(r.prompt_token_ids), r.sampling_params.max_tokens, r.trace_headers]
                for r in step.given
            ]
            data = stream_channel.json_frame(stream_channel.REQUESTS, rows) + data
        if not self.steps:
            data = self._hello + data
        self.steps.append(Step(data, step.causes, step.tokens, len(step.outputs.outputs)))


class Evictor:
    """The engine's work between two outputs, as the CPU caches see it: ``mib`` MiB copied."""

    def __init__(self, mib: int) -> None:
        self.mib = mib
        self._src, self._dst = bytearray(mib << 20), bytearray(mib << 20)

    def __call__(self) -> None:
        if self.mib:
            self._dst[:] = self._src


class Consumer:
    """``package``'s stream consumer with its thread not started: the bench calls, in this
    thread, what the thread calls for a readable socket. Providers from ``setup_telemetry`` (the
    environment: :data:`ENV`), fed through a socket pair and the cause channel."""

    def __init__(self, package: str) -> None:
        def module(name: str) -> Any:
            return importlib.import_module(f"{package}.{name}")

        self.package = package
        config = module("config.settings").TelemetryConfig.from_env(defaults={"model_name": "tiny-llama"})
        self.handle = module("export.setup").setup_telemetry(config, port_taken="warn")
        self.folder = tempfile.mkdtemp(prefix="bench-vllm-stream-")
        self.consumer = vllm_module(package, "frontend.stream_consumer").StreamConsumer(self.folder, handle=self.handle)
        self.engine, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.peer.setblocking(False)
        self.consumer._connections[self.peer] = vllm_module(package, "channels.stream_channel").Connection(self.peer)
        self.causes = vllm_module(package, "channels.cause_channel").Sender(self.folder)
        self._sockets = [self.consumer._listener, self.peer]

    def send(self, steps: Sequence[Step], evict: Evictor) -> None:
        """What the engine core sends after each of ``steps``, each after its work (``evict``)."""
        for step in steps:
            evict()
            for record in step.causes:
                self.causes.send(record)
            self.engine.sendall(step.data)

    def read(self) -> tuple[int, int]:
        """What the consumer's thread does when the stream's socket is readable: (ns in its
        loop's ``select``, ns in its ``_read``)."""
        clock = time.perf_counter_ns
        t0 = clock()
        select.select(self._sockets, [], [], 0)
        t1 = clock()
        self.consumer._read(self.peer)
        return t1 - t0, clock() - t1

    def export_ns(self) -> int:
        """CPU ns of exporting the spans ended so far (they wait in the batch span processor)."""
        t0 = time.thread_time_ns()
        self.handle.tracer_provider.force_flush()
        return time.thread_time_ns() - t0

    def metrics(self) -> dict[str, float]:
        """Every sample of its /metrics, names as this tree's."""
        from otel_llm.testing.vllm.server import scrape

        samples = scrape(f"http://127.0.0.1:{self.handle.prometheus_port}/metrics")
        return {
            name.replace(self.package, "otel_llm") + str(sorted(labels)): value
            for (name, labels), value in samples.items()
            if not name.startswith(("process_", "python_", "target_info"))
        }

    def close(self) -> None:
        self.engine.close()
        self.peer.close()
        self.consumer._causes.close()
        self.consumer._listener.close()
        self.handle.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)


def vllm_module(package: str, where: str) -> Any:
    """``package``'s module ``integrations.vllm.<where>`` (``channels.stream_channel``, say); in a
    revision from before the vLLM integration's sub-packages, the same module at its top."""
    try:
        return importlib.import_module(f"{package}.integrations.vllm.{where}")
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith(f"{package}.integrations.vllm."):
            raise
        return importlib.import_module(f"{package}.integrations.vllm.{where.rsplit('.', 1)[-1]}")


def package_copy(name: str, source: str, root: Path) -> tuple[str, str]:
    """A copy of ``otel_llm`` from ``source`` (a git revision, or a directory holding
    ``otel_llm/``) under ``root``, importable as ``otel_llm_<name>``: (its package name, what it is)."""
    package = f"otel_llm_{name}"
    target = root / package
    if os.path.isdir(source):
        shutil.copytree(Path(source) / "otel_llm", target, ignore=shutil.ignore_patterns("__pycache__"))
        what = os.path.abspath(source)
    else:
        git = ["git", "-C", str(ROOT)]
        archive = subprocess.run([*git, "archive", "--format=tar", source, "otel_llm"], check=True, capture_output=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(root / "git", filter="data")
        (root / "git" / "otel_llm").rename(target)
        rev = subprocess.run([*git, "rev-parse", "--short", source], check=True, capture_output=True, text=True)
        what = f"{source} ({rev.stdout.strip()})"
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\botel_llm\b", package, path.read_text()))
    return package, what


def _disagree(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """The samples where two consumers' /metrics differ beyond float rounding (each places the
    arrivals on the engine clock by its own reading of the wall clock)."""
    return sorted(
        k for k in a.keys() | b.keys() if not math.isclose(a.get(k, math.nan), b.get(k, math.nan), rel_tol=1e-6)
    )


def measure(stream: Stream, variants: dict[str, tuple[str, int]], reps: int, evict: Evictor) -> dict[str, Any]:
    """Every variant's consumer (``name: (package, steps per read)``) fed the same stream,
    :data:`SLICE` steps at a time in turn (the order rotated every slice); per repetition, fresh
    consumers warmed on the first load (untimed)."""
    warmup, timed = stream.steps[: stream.load_starts[1]], stream.steps[stream.load_starts[1] :]
    names = list(variants)
    runs: dict[str, dict[str, list[float]]] = {n: {"loop": [], "consumer": [], "span_export": []} for n in names}
    mismatches: list[str] = []
    for _ in range(reps):
        consumers = {n: Consumer(variants[n][0]) for n in names}
        try:
            for consumer in consumers.values():
                for step in warmup:
                    consumer.send([step], Evictor(0))
                    consumer.read()
                consumer.export_ns()
            gc.collect()
            totals = {n: [0, 0] for n in names}
            for i, start in enumerate(range(0, len(timed), SLICE)):
                k = i % len(names)
                for n in names[k:] + names[:k]:
                    consumer, total, per_read = consumers[n], totals[n], variants[n][1]
                    for first in range(start, min(start + SLICE, len(timed)), per_read):
                        consumer.send(timed[first : min(first + per_read, start + SLICE)], evict)
                        loop, read = consumer.read()
                        total[0] += loop
                        total[1] += read
            for n in names:
                runs[n]["loop"].append(totals[n][0] / 1e3 / len(timed))
                runs[n]["consumer"].append(totals[n][1] / 1e3 / len(timed))
                runs[n]["span_export"].append(consumers[n].export_ns() / 1e3 / len(timed))
            seen = {n: c.metrics() for n, c in consumers.items()}
            for n in names[1:]:
                mismatches += [f"{n}: {k}" for k in _disagree(seen[names[0]], seen[n])]
        finally:
            for consumer in consumers.values():
                consumer.close()
    tokens_per_step = sum(s.tokens for s in timed) / len(timed)
    out: dict[str, Any] = {"evict_mib": evict.mib, "us_per_step": {}, "us_per_token": {}}
    for n in names:
        per_step = {part: median(values) for part, values in runs[n].items()}
        per_step["total"] = median([sum(parts) for parts in zip(*runs[n].values())])
        out["us_per_step"][n] = per_step
        out["us_per_token"][n] = {part: v / tokens_per_step for part, v in per_step.items()}
    if names[0].startswith("base"):
        totals_by_rep = {n: [sum(parts) for parts in zip(*runs[n].values())] for n in names}
        out["ratios_paired_median"] = {
            f"{n}/{names[0]} {part}": median([ratio(a, b) for a, b in zip(values[n], values[names[0]])])
            for part, values in (("consumer", {n: runs[n]["consumer"] for n in names}), ("total", totals_by_rep))
            for n in names[1:]
        }
    out["metrics_agree"] = not mismatches
    out["metrics_mismatches"] = mismatches[:20]
    out["repetitions"] = runs
    return out


def stages(stream: Stream, evict: Evictor, per_read: int) -> dict[str, float]:
    """Where this tree's consumer spends its time, µs per step: its parts timed by wrapping them
    (about 0.1 µs each per call added), frames and dispatch by difference."""
    consumer = Consumer("otel_llm")
    spent: dict[str, int] = {}

    def wrap(owner: Any, attribute: str, stage: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[stage] = spent.get(stage, 0) + time.perf_counter_ns() - t0

        setattr(owner, attribute, timed)

    timed = stream.steps[stream.load_starts[1] :]
    loop = read = 0
    try:
        for step in stream.steps[: stream.load_starts[1]]:
            consumer.send([step], Evictor(0))
            consumer.read()
        c = consumer.consumer
        (engine,) = c._engines.values()
        wrap(c, "_recv", "recv")
        wrap(c._causes, "drain", "causes_drain")
        wrap(engine.telemetry, "credit_causes", "credit_causes")
        wrap(c, "_decode", "decode")
        wrap(engine.translator, "_publish", "telemetry")
        wrap(engine.translator, "outputs", "translate")
        for i in range(0, len(timed), per_read):
            consumer.send(timed[i : i + per_read], evict)
            a, b = consumer.read()
            loop, read = loop + a, read + b
    finally:
        consumer.close()
    spent["translate"] -= spent["telemetry"]
    spent["frames, dispatch"] = read - sum(spent.values())
    spent["loop"] = loop
    return {stage: ns / 1e3 / len(timed) for stage, ns in spent.items()}


def profile(stream: Stream, top: int = 25) -> list[dict[str, Any]]:
    """cProfile of this tree's consumer over the timed steps, warm (deterministic profiling
    inflates the cost of each call): the top functions by own time, µs per step."""
    consumer = Consumer("otel_llm")
    profiler = cProfile.Profile()
    timed = stream.steps[stream.load_starts[1] :]
    try:
        for step in stream.steps[: stream.load_starts[1]]:
            consumer.send([step], Evictor(0))
            consumer.read()
        for step in timed:
            consumer.send([step], Evictor(0))
            profiler.enable()
            consumer.consumer._read(consumer.peer)
            profiler.disable()
    finally:
        consumer.close()
    rows = []
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats  # type: ignore[attr-defined]
    for (path, line, function), (_, calls, own, cumulative, _) in stats.items():
        where = path.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        rows.append(
            {
                "function": f"{where}:{line}({function})",
                "calls_per_step": calls / len(timed),
                "own_us_per_step": 1e6 * own / len(timed),
                "cumulative_us_per_step": 1e6 * cumulative / len(timed),
            }
        )
    return sorted(rows, key=lambda r: r["own_us_per_step"], reverse=True)[:top]


def run(
    loads: int,
    reps: int,
    evict_mib: Sequence[int],
    steps_per_read: Sequence[int],
    against: Optional[str],
    trees: Sequence[str],
    with_profile: bool,
) -> dict[str, Any]:
    from otel_llm.testing.span_receiver import SpanReceiver

    os.environ.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    copies = Path(tempfile.mkdtemp(prefix="bench-vllm-stream-packages-"))
    sys.path.insert(0, str(copies))
    packages, sources = {}, {"ours": str(ROOT)}
    for name, source in ([("base", against)] if against else []) + [tuple(t.split("=", 1)) for t in trees]:
        packages[name], sources[name] = package_copy(name, source, copies)
    packages["ours"] = "otel_llm"
    variants = {
        name if len(steps_per_read) == 1 else f"{name}@{k}": (package, k)
        for name, package in packages.items()
        for k in steps_per_read
    }
    stream = Stream(loads + 1)
    timed = stream.steps[stream.load_starts[1] :]
    result: dict[str, Any] = {"variants": sources, "steps_per_read": list(steps_per_read), "by_eviction": {}}
    try:
        with SpanReceiver() as receiver:
            os.environ.update({**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint})
            for mib in evict_mib:
                evict = Evictor(mib)
                result["by_eviction"][f"{mib}MiB"] = {
                    **measure(stream, variants, reps, evict),
                    "stages_us_per_step": stages(stream, evict, steps_per_read[0]),
                }
            if with_profile:
                result["profile"] = profile(stream)
            spans = len(receiver.named("llm_request"))
    finally:
        shutil.rmtree(copies, ignore_errors=True)
    # Every consumer is fed every load: per eviction size, one per variant and repetition, and the stages'.
    expected = (len(evict_mib) * (reps * len(variants) + 1) + with_profile) * stream.model.requests
    return result | {
        "method": "vLLM's engine-core stream (EngineCoreOutputs of vLLM's classes, encoded by its MsgpackEncoder, "
        "framed as the engine core's tap does) from a model of vLLM's scheduler under bench.vllm.rust's load, fed "
        "through a socket pair to StreamConsumer._read (its thread not started; select on its sockets timed "
        "apart as 'loop'), on setup_telemetry's providers with bench.vllm.rust's otel settings; before each step "
        "N MiB copied (the engine's work evicting the caches, untimed); variants interleaved "
        f"{SLICE} steps at a time, the order rotated; medians over repetitions of the mean per step",
        "stream": {
            "loads_timed": loads,
            "requests_per_load": REQUESTS,
            "max_tokens": MAX_TOKENS,
            "steps_timed": len(timed),
            "tokens_per_step": sum(s.tokens for s in timed) / len(timed),
            "outputs_per_step": sum(s.outputs for s in timed) / len(timed),
            "preemptions_per_load": stream.model.preemptions / (loads + 1),
            "bytes_per_step": sum(len(s.data) for s in timed) / len(timed),
        },
        "spans_received": spans,
        "spans_expected": expected,
    }


def table_lines(r: dict[str, Any]) -> list[str]:
    s = r["stream"]
    lines = [
        f"vLLM engine-core stream consumer, µs per engine step ({s['steps_timed']} steps, "
        f"{s['tokens_per_step']:.2f} tokens per step, {s['preemptions_per_load']:.0f} preemptions per load)",
        "   " + ", ".join(f"{name}: {source}" for name, source in r["variants"].items()),
        f"   {'evicted':<9}{'variant (@ steps per read)':<28}{'loop':>7}{'consumer':>10}{'export':>8}{'total':>8}"
        f"{'/token':>8}",
    ]
    for evicted, m in r["by_eviction"].items():
        for name, parts in m["us_per_step"].items():
            lines.append(
                f"   {evicted:<9}{name:<28}{parts['loop']:>7.1f}{parts['consumer']:>10.1f}{parts['span_export']:>8.1f}"
                f"{parts['total']:>8.1f}{m['us_per_token'][name]['total']:>8.1f}"
            )
        for key, value in m.get("ratios_paired_median", {}).items():
            lines.append(f"   {evicted:<9}{key}: {value:.3f} (paired median)")
        lines.append(
            f"   {evicted:<9}stages (ours, @{r['steps_per_read'][0]}): "
            + ", ".join(f"{k} {v:.1f}" for k, v in m["stages_us_per_step"].items())
        )
        lines.append(f"   {evicted:<9}metrics agree: {m['metrics_agree']}")
    for row in r.get("profile", [])[:12]:
        lines.append(
            f"   profile: {row['own_us_per_step']:6.2f} own {row['cumulative_us_per_step']:6.2f} cum "
            f"{row['calls_per_step']:5.2f}/step  {row['function']}"
        )
    lines.append(f"   spans received {r['spans_received']} of {r['spans_expected']}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm.stream",
        description="What the consumer of vLLM's engine-core stream (Rust frontend) costs per engine step.",
    )
    p.add_argument("--loads", type=int, default=2, help="loads of 64 requests timed, after one warm-up (default 2)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument(
        "--evict", type=int, nargs="+", default=[0, 16], help="MiB copied before each step, a run each (default 0 16)"
    )
    p.add_argument(
        "--steps-per-read",
        type=int,
        nargs="+",
        default=[1],
        help="engine steps written per read, each variant at each (default 1)",
    )
    p.add_argument("--against", metavar="REV", help="also otel_llm as of this git revision (variant base)")
    p.add_argument(
        "--tree", action="append", default=[], metavar="NAME=DIR", help="also the otel_llm in DIR (variant NAME)"
    )
    p.add_argument("--profile", action="store_true", help="add a cProfile of this tree's consumer")
    p.add_argument("--out", type=Path, default=BENCH / "results.json", help=f"JSON to update (key {KEY})")
    args = p.parse_args(argv)
    return write_section(
        KEY,
        args.out,
        lambda: run(args.loads, args.reps, args.evict, args.steps_per_read, args.against, args.tree, args.profile),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
