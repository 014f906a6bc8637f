"""Write collector/'s generated files (``python -m collector.generate``), or with ``--check`` list
the ones that differ from what the generator makes now and exit 1."""

from __future__ import annotations

import argparse
import sys

from . import generated_files
from .profiles import EVICTOR_THRESHOLD
from .sdk import WrongSDK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collector.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    parser.add_argument(
        "--evictor-threshold",
        type=float,
        default=EVICTOR_THRESHOLD,
        help=f"alert on a request that caused more preemptions than this, a preemption bucket boundary "
        f"(default {EVICTOR_THRESHOLD:g}; the rules' unit tests are written for the default)",
    )
    args = parser.parse_args(argv)
    try:
        files = generated_files(args.evictor_threshold)
    except (WrongSDK, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path}: differs from the generator's output (run `make dashboards`)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
