"""The transformers releases this instrumentation supports (``instrumentation_dependencies()``),
and the two the suite runs on: the oldest of the range and the newest (``transformers.mk`` reads
:data:`TESTED_VERSIONS`: moving the matrix to a new release is one line here)."""

import sys

TESTED_VERSIONS = ("5.18.0", "5.25.0")

# Up to the newest tested release's minor version; a later one is instrumented as far as the
# checks hold, with one warning.
_newest = TESTED_VERSIONS[-1].split(".")
_instruments = (f"transformers >= {TESTED_VERSIONS[0]}, < {_newest[0]}.{int(_newest[1]) + 1}",)

if __name__ == "__main__":  # transformers.mk: `python package.py oldest|newest`
    print(TESTED_VERSIONS[0] if sys.argv[1:] == ["oldest"] else TESTED_VERSIONS[-1])
