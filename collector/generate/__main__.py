"""Write collector/'s generated files (``python -m collector.generate``), or with ``--check`` list
the ones that differ from what the generator makes now and exit 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .dashboard import DASHBOARDS_DIR, WrongSDK, dashboard_file, render_dashboard
from .profiles import PROFILES, Profile
from .rules import RULES_DIR, render_rules, render_tests, rules_file, tests_file


def generated_files() -> dict[Path, str]:
    """Every generated file, path -> text, for both naming profiles."""
    out: dict[Path, str] = {}
    for naming in PROFILES:
        p = Profile(naming)
        out[DASHBOARDS_DIR / dashboard_file(p)] = render_dashboard(p)
        out[RULES_DIR / rules_file(p)] = render_rules(p)
        if naming != "vllm":  # the vllm profile's unit tests are the hand-written source of the others
            out[RULES_DIR / tests_file(p)] = render_tests(p)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collector.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = parser.parse_args(argv)
    try:
        files = generated_files()
    except WrongSDK as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path}: differs from the generator's output (run `make dashboards`)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(text := files[path])
        print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
