"""What the demos print on a terminal: progress, the preemption histogram as a bar chart, the
worst requests and the worst evictors, the summary."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

BAR_WIDTH = 40


THRASHING = 5  # preemptions from which a request counts as thrashing


class Progress:
    """Progress on ``stream`` (stderr). On a terminal (``stream`` and stdout both), a one-line bar
    redrawn in place at most ten times a second. Otherwise (``otel-llm demo | tee log``, output to
    a file) whole lines and no carriage return: one every ``line_every`` seconds when given, else
    one per 10% of ``total`` finished (ten lines in all)."""

    STEPS = 10

    def __init__(self, total: int, stream: Any = sys.stderr, line_every: Optional[float] = None) -> None:
        self.total = total
        self.stream = stream
        self.redraw = stream.isatty() and sys.stdout.isatty()
        self.line_every = line_every
        self.interval = 0.1 if self.redraw else (line_every or 0.0)
        self._last = 0.0
        self._step = 0  # 10% steps already written (lines without line_every)

    def __call__(self, engine: Any, finished: int) -> None:
        self.show(
            finished, engine.num_running, engine.num_waiting, engine.kv_cache.usage, engine.scheduler.num_preemptions
        )

    def _line(self, finished: int, running: int, waiting: int, kv_usage: float, preemptions: int) -> str:
        filled = BAR_WIDTH * finished // max(self.total, 1)
        return (
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {finished}/{self.total} finished"
            f" | running {running:3d} waiting {waiting:3d}"
            f" | KV {kv_usage:4.0%} | preemptions {preemptions}"
        )

    def show(self, finished: int, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        if not self.redraw and self.line_every is None:
            # One line per 10% step passed; a step that finished several requests may pass two.
            passed = self._step
            while self._step < self.STEPS and finished * self.STEPS >= (self._step + 1) * self.total:
                self._step += 1
                line = self._line(finished, running, waiting, kv_usage, preemptions)
                self.stream.write(f"{100 * self._step // self.STEPS:3d}% {line}\n")
            if self._step > passed:
                self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last < self.interval and finished < self.total:
            return
        self._last = now
        line = self._line(finished, running, waiting, kv_usage, preemptions)
        self.stream.write(f"\r{line}" if self.redraw else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.redraw:
            self.stream.write("\n")
            self.stream.flush()


def bucket_labels(bounds: Sequence[float]) -> list[str]:
    """Labels for integer observations: bucket i holds the integers in (bounds[i-1], bounds[i]]."""
    labels = []
    low = 0
    for bound in bounds:
        high = math.floor(bound)
        labels.append(str(low) if high <= low else f"{low}-{high}")
        low = high + 1
    labels.append(f"{low}+")
    return labels


def bar_chart(labels: Sequence[str], counts: Sequence[int]) -> list[str]:
    total = sum(counts) or 1
    peak = max(counts, default=0) or 1
    width = max(len(label) for label in labels)
    lines = []
    for label, count in zip(labels, counts):
        bar = "#" * math.ceil(BAR_WIDTH * count / peak)
        lines.append(f"  {label:>{width}} | {bar:<{BAR_WIDTH}} {count:5d} ({count / total:6.1%})")
    return lines


def plot(labels: Sequence[str], counts: Sequence[int], title: str) -> Any:
    """The chart as a matplotlib Figure. A log-scale y axis: the thrashing tail (a few requests
    against hundreds at 0) would be flat on a linear one. Every bar is labelled with its count,
    0 included (an empty bucket draws no bar on a log scale)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(labels, counts, color="#4c72b0")
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(max(counts, default=1), 1) * 2)  # room above the tallest bar for its label
    for x, count in enumerate(counts):
        ax.annotate(str(count), (x, max(count, 0.5)), ha="center", va="bottom")
    ax.set_xlabel("preemptions per request")
    ax.set_ylabel("requests (log scale)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def write_plot(path: str, labels: Sequence[str], counts: Sequence[int], title: str) -> None:
    import matplotlib.pyplot as plt

    fig = plot(labels, counts, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class PreemptionHistogram:
    """``request_num_preemptions`` as the summary shows it: per-bucket (not cumulative) counts."""

    bounds: list[float]
    counts: list[int]
    count: int
    sum: float

    @classmethod
    def from_point(cls, point: Any) -> "PreemptionHistogram":
        return cls(list(point.explicit_bounds), list(point.bucket_counts), point.count, point.sum)

    @classmethod
    def from_scrape(cls, samples: Mapping[tuple[str, frozenset], float], name: str) -> "PreemptionHistogram":
        """From a scrape of one series (``{(sample name, labels): value}``); its buckets are cumulative."""
        cumulative = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in samples.items()
            if sample == f"{name}_bucket"
        )
        [count] = [v for (sample, _), v in samples.items() if sample == f"{name}_count"]
        [total] = [v for (sample, _), v in samples.items() if sample == f"{name}_sum"]
        counts = [int(c - below) for (_, c), below in zip(cumulative, [0.0] + [c for _, c in cumulative])]
        return cls([le for le, _ in cumulative if math.isfinite(le)], counts, int(count), total)


def print_fields(rows: Sequence[tuple[str, object]]) -> None:
    for key, value in rows:
        print(f"{key:<15}{value}")


def print_chart(histogram_name: str, histogram: PreemptionHistogram) -> list[str]:
    """Prints the bar chart of requests per preemption count; returns its labels."""
    labels = bucket_labels(histogram.bounds)
    print(f"requests per preemption count ({histogram_name})")
    for line in bar_chart(labels, histogram.counts):
        print(line)
    return labels


def print_worst(by_request: Mapping[str, tuple[int, str]], top: int) -> None:
    """The ``top`` requests with the most preemptions: ``by_request`` maps id to (count, trace id)."""
    worst = sorted(by_request.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    print("worst requests")
    width = max((len(request_id) for request_id, _ in worst), default=0)
    for request_id, (count, trace_id) in worst:
        print(f"  {request_id:<{width}}  {count:3d} preemptions  trace_id {trace_id}")


def evicted_brief(victims: Mapping[str, int], evictor: str, shown: int = 3) -> str:
    """Whom ``evictor`` evicted, in brief: the ``shown`` requests it evicted most often, ``itself``
    where it was its own cause, with the times each; then how many others, how many times."""
    ranked = sorted(victims.items(), key=lambda kv: (-kv[1], kv[0]))
    named = [f"{'itself' if victim == evictor else victim} x{n}" for victim, n in ranked[:shown]]
    rest = ranked[shown:]
    if rest:
        named.append(f"+{len(rest)} others x{sum(n for _, n in rest)}")
    return ", ".join(named) or "(no victim's span names it)"


def print_worst_evictors(
    caused: Mapping[str, tuple[int, str]], victims: Mapping[str, Mapping[str, int]], top: int
) -> None:
    """The ``top`` requests whose KV demand caused the most preemptions: ``caused`` maps id to
    (that count, trace id), ``victims`` id to whom it evicted (victim id to times)."""
    ranked = sorted(((r, v) for r, v in caused.items() if v[0] > 0), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    print("worst evictors")
    if not ranked:
        print("  none: no preemption names a request as its cause")
    width = max((len(request_id) for request_id, _ in ranked), default=0)
    for request_id, (count, trace_id) in ranked:
        brief = evicted_brief(victims.get(request_id, {}), request_id)
        print(f"  {request_id:<{width}}  {count:3d} preemptions caused  trace_id {trace_id}  evicted {brief}")


SPINNER = "|/-\\"


class Waiting:
    """Shows that a slow start is alive: a spinner on a terminal, else a line every ``line_every`` s."""

    def __init__(self, what: str, stream: Any = sys.stderr, line_every: float = 10.0) -> None:
        self.what = what
        self.stream = stream
        self.line_every = line_every
        self.tty = stream.isatty()
        self._start = self._last = time.monotonic()
        self._ticks = 0

    def __call__(self) -> None:
        now = time.monotonic()
        if self.tty:
            self._ticks += 1
            self.stream.write(f"\r{self.what} {SPINNER[self._ticks % 4]} {now - self._start:.0f} s")
        elif now - self._last >= self.line_every:
            self._last = now
            self.stream.write(f"{self.what}: {now - self._start:.0f} s\n")
        self.stream.flush()

    def done(self) -> None:
        end = "\r" if self.tty else ""
        self.stream.write(f"{end}{self.what}: ready in {time.monotonic() - self._start:.0f} s\n")
        self.stream.flush()
