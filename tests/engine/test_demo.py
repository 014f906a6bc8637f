"""`otel-llm demo`, run small: what its summary says is what its /metrics endpoint serves, and the
worst evictors it names are the ones the engine recorded at its preemption points."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, TypedDict

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm._sdk import unmet
from otel_llm.cli.demo import where_traces_are
from otel_llm.cli.render import Progress, bar_chart, bucket_labels, plot

READY_TIMEOUT = 120  # seconds: the run itself takes about one


def demo_command() -> list[str]:
    script = Path(sys.executable).with_name("otel-llm")  # the installed console script
    if script.exists():
        return [str(script), "demo"]
    found = shutil.which("otel-llm")
    return [found, "demo"] if found else [sys.executable, "-m", "otel_llm.cli", "demo"]


def read_until_serving(proc: subprocess.Popen[str]) -> tuple[list[str], str]:
    """Summary lines, and the URL from the 'serving' line that says the endpoint is up."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    while True:
        line = lines.get(timeout=READY_TIMEOUT)
        if line is None:
            pytest.fail("demo ended before serving /metrics:\n" + "\n".join(seen))
        match = re.match(r"serving (http://\S+/metrics) for", line)
        if match:
            return seen, match.group(1)
        seen.append(line)


class Summary(TypedDict):
    requests: int
    preemptions: int
    buckets: list[tuple[str, int]]  # (label, count)
    worst: list[tuple[str, int, str]]  # (request id, preemptions, trace id)


def parse_summary(lines: list[str]) -> Summary:
    fields: dict[str, int] = {}
    for line in lines:
        m = re.match(r"(requests|preemptions)\s+(\d+)$", line)
        if m:
            fields[m.group(1)] = int(m.group(2))
    buckets = [(m.group(1), int(m.group(2))) for line in lines if (m := re.match(r"\s+(\S+) \| #*\s+(\d+) \(", line))]
    worst = [
        (m.group(1), int(m.group(2)), m.group(3))
        for line in lines
        if (m := re.match(r"\s+(req-\d+)\s+(\d+) preemptions\s+trace_id ([0-9a-f]{32})$", line))
    ]
    return Summary(requests=fields["requests"], preemptions=fields["preemptions"], buckets=buckets, worst=worst)


class Evictor(NamedTuple):
    request_id: str
    caused: int
    trace_id: str
    evicted: list[tuple[str, int]]  # (victim, times) as listed; "itself" where it was its own cause
    others: tuple[int, int]  # (requests, times) summed up as "+N others xM"


EVICTOR = re.compile(r"\s+(req[-_]\d+)\s+(\d+) preemptions caused  trace_id ([0-9a-f]{32})  evicted (.*)$")


def parse_evictors(lines: list[str]) -> list[Evictor]:
    """The lines under "worst evictors"."""
    evictors = []
    for line in lines:
        if m := EVICTOR.match(line):
            listed, others = [], (0, 0)
            for part in m.group(4).split(", "):
                if o := re.fullmatch(r"\+(\d+) others x(\d+)", part):
                    others = (int(o.group(1)), int(o.group(2)))
                else:
                    victim, times = part.split(" x")
                    listed.append((victim, int(times)))
            evictors.append(Evictor(m.group(1), int(m.group(2)), m.group(3), listed, others))
    return evictors


def check_evictors(evictors: list[Evictor], caused: Mapping[str, int], victims: Mapping[str, Counter[str]]) -> None:
    """The worst evictors listed are the top 5 of ``caused`` (most first, then by id), each with
    whom it evicted as ``victims`` has it: the three it evicted most, then the others summed up."""
    assert [e.request_id for e in evictors] == sorted((r for r in caused if caused[r]), key=lambda r: (-caused[r], r))[
        :5
    ]
    for e in evictors:
        assert e.caused == caused[e.request_id]
        ranked = sorted(victims[e.request_id].items(), key=lambda kv: (-kv[1], kv[0]))
        named = [("itself" if victim == e.request_id else victim, n) for victim, n in ranked]
        assert e.evicted == named[:3], e
        assert e.others == (len(named[3:]), sum(n for _, n in named[3:])), e


def parse_scrape(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def one(samples: dict[str, float], prefix: str) -> float:
    [value] = [v for k, v in samples.items() if k.startswith(prefix + "{")]
    return value


@contextlib.contextmanager
def sigint_not_ignored() -> Iterator[None]:
    """Children started meanwhile get SIGINT's default action. A child inherits an ignored
    SIGINT (this process started by ``nohup``, or with ``&`` from a script), and Python then
    never raises KeyboardInterrupt in it; a handled signal is reset to its default by exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_demo_summary_matches_its_metrics_endpoint(tmp_path: Path) -> None:
    with sigint_not_ignored():
        proc = subprocess.Popen(
            demo_command() + ["--requests", "40", "--prometheus-port", "0", "--serve-seconds", "300", "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "stderr.txt").open("w"),
            text=True,
        )
    try:
        lines, url = read_until_serving(proc)
        with urllib.request.urlopen(url, timeout=READY_TIMEOUT) as response:
            samples = parse_scrape(response.read().decode())
        proc.send_signal(signal.SIGINT)  # stop serving: the demo shuts down cleanly
        assert proc.wait(timeout=60) == 0, (tmp_path / "stderr.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    summary = parse_summary(lines)
    assert summary["requests"] == 40 == one(samples, "vllm:request_num_preemptions_count")
    assert summary["preemptions"] == one(samples, "vllm:num_preemptions_total")
    assert summary["preemptions"] == one(samples, "vllm:request_num_preemptions_sum")
    assert summary["preemptions"] > 0  # the default KV cache is small enough to preempt

    served = {
        m.group(1): v
        for k, v in samples.items()
        if (m := re.match(r'vllm:request_num_preemptions_bucket\{.*le="([^"]+)"', k))
    }
    bounds = sorted((float(le) for le in served if le != "+Inf"))
    labels = bucket_labels(bounds)
    buckets = summary["buckets"]
    assert [label for label, _ in buckets] == labels
    cumulative = list(accumulate(count for _, count in buckets))
    assert cumulative == [served[le] for le in sorted(served, key=float)]

    worst = summary["worst"]
    assert len(worst) == 5
    # The worst request (read from its span) lies in the highest non-empty histogram bucket.
    top = max(i for i, (_, count) in enumerate(buckets) if count > 0)
    low = 0 if top == 0 else math.floor(bounds[top - 1]) + 1
    high = math.floor(bounds[top]) if top < len(bounds) else math.inf
    assert low <= worst[0][1] <= high
    assert [count for _, count, _ in worst] == sorted((count for _, count, _ in worst), reverse=True)
    assert len({trace for _, _, trace in worst}) == 5

    # Each preemption here has one cause: the preemptions caused add up to the preemptions.
    assert one(samples, "vllm:request_num_preemptions_caused_sum") == summary["preemptions"]
    evictors = parse_evictors(lines)
    assert len(evictors) == 5 and evictors[0].caused == max(e.caused for e in evictors)


def test_demo_on_a_taken_port_says_so_in_one_line_and_gives_its_summary_without_serving() -> None:
    with socket.socket() as taken:  # another process's endpoint, as far as the demo can tell
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # --serve-seconds 300 beyond the timeout: a demo that waited to serve would fail here.
        run = subprocess.run(
            demo_command()
            + ["--requests", "20", "--prometheus-port", str(port), "--serve-seconds", "300", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        )
    assert run.returncode == 0, run.stderr
    # Before it, on an SDK older than the fast paths want (make test-sdk-oldest), the one warning
    # that says so: a line, and one per contract that does not hold.
    sdk_notice = 1 + len(unmet()) if unmet() else 0
    assert run.stderr.splitlines()[sdk_notice:] == [
        f"otel-llm demo: port 127.0.0.1:{port} is taken (Address already in use): this run serves no /metrics; "
        "--prometheus-port 0 picks a free port"
    ]
    assert parse_summary(run.stdout.splitlines())["requests"] == 20
    assert "serving" not in run.stdout
    assert run.stdout.endswith(f"\n{where_traces_are()}\n\n")  # where the trace ids listed lead


def test_the_demo_says_where_its_trace_ids_can_be_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        monkeypatch.delenv(var, raising=False)
    assert where_traces_are() == (
        "the trace ids above: this run exported no spans; `make demo-stack` shows them in a local Phoenix "
        "(and each bucket in Prometheus), or OTEL_EXPORTER_OTLP_ENDPOINT=<your collector> sends them there"
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert where_traces_are() == "the trace ids above: the request spans went over OTLP to http://collector:4317"


def test_demo_names_the_worst_evictors_as_the_engine_recorded_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process, to read the engine's outputs (its own record of each preemption's cause) and
    the request spans as exported, beside what the demo prints."""
    import engine_stub.workload
    import otel_llm.integrations.engine_stub as integration
    from otel_llm.cli import main

    results: list[Any] = []
    run_workload, register = engine_stub.workload.run_workload, integration.register

    def recorded_run(*args: Any, **kwargs: Any) -> Any:
        results.append(run_workload(*args, **kwargs))
        return results[-1]

    exported = InMemorySpanExporter()

    def register_also_in_memory(*args: Any, extra_span_processors: Any = (), **kwargs: Any) -> Any:
        processors = [*extra_span_processors, SimpleSpanProcessor(exported)]
        return register(*args, extra_span_processors=processors, **kwargs)

    monkeypatch.setattr(engine_stub.workload, "run_workload", recorded_run)
    monkeypatch.setattr(integration, "register", register_also_in_memory)
    assert main(["demo", "--requests", "200", "--prometheus-port", "0", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ground truth   telemetry equals the engine" in lines

    [result] = results
    caused = {o.request_id: o.num_preemptions_caused for o in result.outputs}
    victims: dict[str, Counter[str]] = {r: Counter() for r in caused}
    for o in result.outputs:
        for cause in o.preempted_by:
            victims[cause][o.request_id] += 1
    evictors = parse_evictors(lines)
    check_evictors(evictors, caused, victims)
    traces = {
        str((span.attributes or {})["gen_ai.request.id"]): format(span.context.trace_id, "032x")
        for span in exported.get_finished_spans()
        if span.name == "llm_request" and span.context is not None
    }
    assert [e.trace_id for e in evictors] == [traces[e.request_id] for e in evictors]
    # This load has every kind of line: an evictor of itself only, of itself and others, of others only.
    kinds = {(any(v == "itself" for v, _ in e.evicted), any(v != "itself" for v, _ in e.evicted)) for e in evictors}
    assert kinds == {(True, False), (True, True), (False, True)}
    assert any(e.others != (0, 0) for e in evictors)


PROGRESS_LINE = re.compile(r"\s*(\d+)% \[[#.]{40}\] (\d+)/(\d+) finished \| ")


def test_demo_into_a_pipe_writes_one_progress_line_per_tenth_and_no_carriage_return() -> None:
    """``make demo | tee log``: stdout and stderr are pipes, not terminals."""
    run = subprocess.run(
        demo_command() + ["--requests", "37", "--prometheus-port", "0"],
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stdout and "\r" not in run.stderr
    progress = [m for line in run.stderr.splitlines() if (m := PROGRESS_LINE.match(line))]
    assert [int(m.group(1)) for m in progress] == list(range(10, 101, 10)), run.stderr
    finished = [int(m.group(2)) for m in progress]
    assert all(n * 10 >= step * 37 for step, n in enumerate(finished, 1))  # each line once its tenth is done
    assert finished == sorted(finished) and finished[-1] == 37
    assert {int(m.group(3)) for m in progress} == {37}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_only_when_stdout_is_a_terminal_too(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = Terminal()
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # stdout into a pipe, stderr on the terminal
    progress = Progress(20, stream=stderr)
    for finished in (0, 1, 2, 7, 20):  # 7 passes the 20% and 30% steps at once
        progress.show(finished, running=1, waiting=0, kv_usage=0.5, preemptions=0)
    progress.close()
    lines = stderr.getvalue().splitlines()
    assert "\r" not in stderr.getvalue()
    assert [line.split("%")[0].strip() for line in lines] == [str(p) for p in range(10, 101, 10)]

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", Terminal())
    progress = Progress(20, stream=terminal)
    progress.show(20, running=0, waiting=0, kv_usage=0.0, preemptions=0)
    progress.close()
    assert terminal.getvalue().startswith("\r[") and terminal.getvalue().endswith("\n")


def test_bucket_labels_name_the_integers_each_bucket_holds() -> None:
    assert bucket_labels([0.5, 1, 2, 3, 4, 5, 10, 20]) == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "6-10",
        "11-20",
        "21+",
    ]
    assert bucket_labels([1, 2, 5]) == ["0-1", "2", "3-5", "6+"]


def test_bar_chart_scales_to_the_largest_bucket() -> None:
    lines = bar_chart(["0", "1", "2+"], [20, 10, 0])
    assert [line.count("#") for line in lines] == [40, 20, 0]
    assert lines[1].endswith("   10 ( 33.3%)")


def test_plot_writes_the_chart_as_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from otel_llm.cli import main

    chart = tmp_path / "chart.png"
    argv = ["demo", "--requests", "10", "--prometheus-port", "0", "--no-progress", "--plot", str(chart)]
    assert main(argv) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart written to {chart}" in capsys.readouterr().out


def test_the_plot_has_a_log_scale_and_every_count_labelled() -> None:
    """The thrashing tail (2 and 3 requests beside 295) stays visible, and empty buckets say 0."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    counts = [295, 147, 43, 8, 2, 0, 3, 2, 0]
    fig = plot(bucket_labels([0.5, 1, 2, 3, 4, 5, 10, 20]), counts, "t")
    try:
        [ax] = fig.axes
        assert ax.get_yscale() == "log"
        assert [text.get_text() for text in ax.texts] == [str(c) for c in counts]
        assert [label.get_text() for label in ax.get_xticklabels()][6:8] == ["6-10", "11-20"]
    finally:
        plt.close(fig)


def test_help_is_plain_text() -> None:
    proc = subprocess.run([sys.executable, "-m", "otel_llm.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "otel-llm: OpenTelemetry instrumentation" in proc.stdout
    assert "``" not in proc.stdout and ":mod:" not in proc.stdout, proc.stdout


def test_demo_without_torch_says_what_to_install_in_one_line() -> None:
    # A Python without torch, as after `pip install otel-llm` without the engine extra: torch is
    # hidden from the import system (None in sys.modules), which a second venv would cost minutes for.
    code = "import sys; sys.modules['torch'] = None; from otel_llm.cli import main; sys.exit(main(['demo']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install 'otel-llm[engine]'" in lines[0] and "make demo" in lines[0], lines


def test_demo_vllm_without_vllm_says_what_to_run_in_one_line() -> None:
    assert importlib.util.find_spec("vllm") is None
    proc = subprocess.run(
        [sys.executable, "-m", "otel_llm.cli", "demo-vllm"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "make demo-vllm" in lines[0], lines
