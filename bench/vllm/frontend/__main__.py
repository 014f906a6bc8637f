"""``python -m bench.vllm.frontend``: the command (and the client and counted processes it starts)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Optional, Sequence

from ...common import write_section
from .. import frontend as package
from . import INSTRUCTIONS_KEY, KEY, ROOT
from .client import client_main
from .frontend import TENANT_VARIANTS, VARIANTS
from .instruction_counts import count_round, instruction_table_lines, run_instructions
from .rounds import LOADS, run, table_lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.frontend", description=package.__doc__.splitlines()[2])
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
    p.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results.json", help="JSON to update (key vllm_frontend)"
    )
    p.add_argument(
        "--instructions",
        action="store_true",
        help=f"instructions per output token under valgrind instead (a round per variant; key {INSTRUCTIONS_KEY})",
    )
    p.add_argument("--jobs", type=int, default=2, help="--instructions: rounds counted at once (default 2)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=(*VARIANTS, *TENANT_VARIANTS),
        default=VARIANTS,
        help="these only (stock always; tenants / replace_tenants: otlp / replace with OTEL_LLM_TENANT=priority, "
        "with --tenants)",
    )
    p.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="every variant's requests carry priorities 0..N-1 under vLLM's priority scheduling "
        f"(key {KEY}_tenants, {INSTRUCTIONS_KEY}_tenants with --instructions)",
    )
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count-round", choices=(*VARIANTS, *TENANT_VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client_main()
    if args.requests < 1 or args.tokens < 3 or args.running < 1 or (args.loads is not None and args.loads < 1):
        p.error("--requests, --running, --loads: at least 1; --tokens: at least 3")
    if args.count_round:
        asyncio.run(
            count_round(args.count_round, args.requests, args.tokens, args.running, args.loads or 1, args.tenants)
        )
        return 0
    if bool(set(TENANT_VARIANTS) & set(args.variants)) != bool(args.tenants):
        p.error("--tenants N (at least 1) and a variant of " + " or ".join(TENANT_VARIANTS) + ", one with the other")
    if args.instructions:
        if args.jobs < 1:
            p.error("--jobs: at least 1")
        # Rounds of several loads (an export per several loads, as at the export interval) keep
        # a key of their own beside the default rounds of one load.
        key = f"{INSTRUCTIONS_KEY}_tenants" if args.tenants else INSTRUCTIONS_KEY
        return write_section(
            key if (args.loads or 1) == 1 else f"{key}_loads{args.loads}",
            args.out,
            lambda: run_instructions(
                args.requests,
                args.tokens,
                args.running,
                args.loads or 1,
                args.jobs,
                args.variants,
                tenants=args.tenants,
            ),
            instruction_table_lines,
        )
    if args.rounds < 3:
        p.error("--rounds: at least 3")
    return write_section(
        f"{KEY}_tenants" if args.tenants else KEY,
        args.out,
        lambda: run(
            args.rounds,
            args.requests,
            args.tokens,
            args.running,
            args.loads or LOADS,
            args.variants,
            not args.no_profile,
            tenants=args.tenants,
        ),
        table_lines,
    )


if __name__ == "__main__":
    sys.exit(main())
