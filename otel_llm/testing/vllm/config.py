"""A ``VllmConfig`` for vLLM's classes on a CPU machine, where nothing runs a model."""

from __future__ import annotations

from typing import Any


def class_level_config(model_config: Any, **kwargs: Any) -> Any:
    """``VllmConfig(model_config=..., **kwargs)``. vLLM 0.34+ refuses an x86 CPU without Triton
    (triton-cpu) when a config is checked; for vLLM's classes, which run no model, Triton is then
    said to be there (``vllm.triton_utils.HAS_TRITON``) and the config built again."""
    from vllm.config import VllmConfig

    try:
        return VllmConfig(model_config=model_config, **kwargs)
    except RuntimeError as exc:
        import vllm.triton_utils

        if "Triton" not in str(exc) or getattr(vllm.triton_utils, "HAS_TRITON", True):
            raise
        vllm.triton_utils.HAS_TRITON = True
        return VllmConfig(model_config=model_config, **kwargs)
