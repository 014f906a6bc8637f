"""The API server side: vLLM's frontend in this process, built for every round with the plugin's
settings of a variant, on the scripted engine core."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, ContextManager, Optional

from otel_llm.testing.vllm.server import ADD_MODE

from ...common import otlp_receiver
from . import ROOT
from .scripted_core import ScriptedCore

VARIANTS = ("stock", "metrics", "spans", "deep_hook", "otlp", "each_step", "replace")
# ``otlp`` and ``replace`` with OTEL_LLM_TENANT=priority: run with --tenants N (every variant's
# requests then carry priorities 0..N-1, under vLLM's priority scheduling policy), not by default.
TENANTS_VARIANT, REPLACE_TENANTS_VARIANT = "tenants", "replace_tenants"
TENANT_VARIANTS = (TENANTS_VARIANT, REPLACE_TENANTS_VARIANT)
MODEL_NAME = "tiny"

# The plugin's settings per variant (everything else unset); None: the plugin not loaded. The deep
# hook is on by default: the variants before it turn it off. Replace mode is the default: a variant
# that does not name a mode runs in add mode (ADD_MODE: the plugin beside vLLM's own logger).
_NO_DEEP_HOOK = {"OTEL_LLM_VLLM_DEEP_HOOK": "0", "OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"}
_PLUGIN_ENV: dict[str, Optional[dict[str, str]]] = {
    "stock": None,
    "metrics": {**_NO_DEEP_HOOK, "OTEL_LLM_SPANS": "false"},
    "spans": _NO_DEEP_HOOK,
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
_PLUGIN_ENV[TENANTS_VARIANT] = {**_PLUGIN_ENV["otlp"], "OTEL_LLM_TENANT": "priority"}  # type: ignore[dict-item]
_PLUGIN_ENV[REPLACE_TENANTS_VARIANT] = {**_PLUGIN_ENV["replace"], "OTEL_LLM_TENANT": "priority"}  # type: ignore[dict-item]


def _vllm_environment(cache: str) -> None:
    for var, value in (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("VLLM_CACHE_ROOT", cache),
    ):
        os.environ.setdefault(var, value)


class Frontend:
    """vLLM's API server in this process, rebuilt for every round (its stat loggers too); a
    round serves ``loads`` loads one after the other; ``tenants``: the requests carry priorities
    ``i % tenants`` (vLLM's priority scheduling policy), none when 0."""

    def __init__(self, model: Path, otlp_http: str, loads: int = 1, tenants: int = 0) -> None:
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
                *(["--scheduling-policy", "priority"] if tenants else []),
            ]
        )
        # Said once per round, as every round builds the app again.
        logging.getLogger("vllm.entrypoints.scale_out.factories").setLevel(logging.WARNING)
        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        self.vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.otlp_http = otlp_http
        self.loads = loads
        self.tenants = tenants
        self._plugin_vars = sorted({k for env in _PLUGIN_ENV.values() if env for k in env} | set(ADD_MODE))

    def _configure(self, variant: str) -> list[Any]:
        """The plugin's environment for ``variant``; the stat-logger factories AsyncLLM loads."""
        from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook
        from otel_llm.integrations.vllm.frontend import stat_logger

        for var in self._plugin_vars + ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"]:
            os.environ.pop(var, None)
        env = _PLUGIN_ENV[variant]
        if env is None:
            return []
        os.environ.update({**ADD_MODE, **env})
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
        from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

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
        # Connections kept open between loads: under callgrind a load's last response and the next
        # load's requests lie further apart than uvicorn's default 5 s, which would close them.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=600)
        server = uvicorn.Server(config)
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
        # As vLLM's server does once started (freeze_gc_heap): the heap at serving time frozen, so
        # that a full collection during the round does not walk every module's objects (about
        # 330 ms here, not what a served request would wait); the last round's heap unfrozen first.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        try:
            with measure if measure is not None else contextlib.nullcontext():
                cpu0, main0 = time.process_time(), time.thread_time()
                client.stdin.write(
                    f"{port} {len(specs)} {specs[0].tokens} {int(scrape)} {self.loads} {self.tenants}\n".encode()
                )
                await client.stdin.drain()
                # Under callgrind a load takes about a minute.
                answer = json.loads(await asyncio.wait_for(client.stdout.readline(), 600 * self.loads))
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


@contextlib.asynccontextmanager
async def serving(loads: int = 1, tenants: int = 0) -> AsyncIterator[tuple[Frontend, Any]]:
    """vLLM's frontend on a tiny model, an OTLP receiver, and the client process."""
    from otel_llm.testing.models import make_tiny_llama

    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.vllm.frontend",
        "--client",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=str(ROOT),
    )
    try:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-frontend-") as tmp, otlp_receiver() as receiver:
            _vllm_environment(str(Path(tmp) / "cache"))
            yield Frontend(make_tiny_llama(Path(tmp) / "tiny-llama"), receiver["http"], loads, tenants), client
    finally:
        if client.stdin is not None:
            client.stdin.close()
        await asyncio.wait_for(client.wait(), 30)
