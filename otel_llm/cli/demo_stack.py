"""``otel-llm demo --stack``: the demo against a local Prometheus and Phoenix (``make demo-stack``)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from otel_llm.cli.demo import demo
from otel_llm.stack.drilldown import StackUnavailable, start_stack
from otel_llm.stack.ports import LOOPBACK, free_port


def demo_on_stack(args: argparse.Namespace) -> int:
    if args.prometheus_host != LOOPBACK:
        print(f"otel-llm demo --stack: the stack runs on {LOOPBACK} only, not --prometheus-host", file=sys.stderr)
        return 2
    args.prometheus_port = args.prometheus_port or free_port()  # Prometheus must know it before the demo starts
    if not args.no_progress:
        print("starting Prometheus and Phoenix (Phoenix takes about 20 s) ...", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as resources:
        try:
            stack = resources.enter_context(start_stack(args.prometheus_port))
        except StackUnavailable as exc:
            print(f"otel-llm demo --stack: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        status = demo(args, stack)
    return status
