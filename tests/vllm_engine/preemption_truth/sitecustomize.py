"""The preemptions of vLLM's scheduler as vLLM itself makes them, recorded independently of
otel-llm: put this folder on PYTHONPATH and OTEL_LLM_TEST_PREEMPTION_TRUTH=<file> in the serve's
environment. Every process loads it at start; the engine core, the one whose scheduler runs,
appends one JSON line per preemption to the file: the victim (vLLM's internal request id), its
preemption count after it, and why: inside ``schedule()``, the request whose
``kv_cache_manager.allocate_slots`` call came last (the one the preemption makes room for);
inside ``reset_prefix_cache``, a cache reset; and the scheduling priority and the LoRA adapter's
name (None for the base model) of the victim and of that request. (otel-llm reads the
scheduler's frame instead.)

Loaded as ``sitecustomize``: vLLM is patched when its scheduler module is first imported.
"""

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys

TRUTH = os.environ.get("OTEL_LLM_TEST_PREEMPTION_TRUTH")
TARGET = "vllm.v1.core.sched.scheduler"


def _patch(module):
    scheduler = module.Scheduler
    state = {"allocating": None, "in": None}
    schedule, reset, preempt = scheduler.schedule, scheduler.reset_prefix_cache, scheduler._preempt_request

    @functools.wraps(schedule)  # otel-llm checks the shape of what it wraps
    def scheduling(self, *args, **kwargs):
        manager = self.kv_cache_manager
        if not getattr(type(manager), "_truth_patched", False):
            allocate = type(manager).allocate_slots

            def allocate_slots(manager_self, request, *a, **k):
                state["allocating"] = request.request_id
                return allocate(manager_self, request, *a, **k)

            type(manager).allocate_slots = allocate_slots
            type(manager)._truth_patched = True
        state["in"] = "schedule"
        try:
            return schedule(self, *args, **kwargs)
        finally:
            state["in"], state["allocating"] = None, None

    @functools.wraps(reset)
    def resetting(self, *args, **kwargs):
        state["in"] = "reset"
        try:
            return reset(self, *args, **kwargs)
        finally:
            state["in"] = None

    @functools.wraps(preempt)
    def preempting(self, request, *args, **kwargs):
        result = preempt(self, request, *args, **kwargs)
        where = state["in"]
        cause = state["allocating"] if where == "schedule" else None
        line = {
            "victim": request.request_id,
            "ordinal": request.num_preemptions,
            "where": where,
            "cause": cause,
            # The scheduling priorities of both, as the scheduler holds them.
            "victim_priority": request.priority,
            "cause_priority": self.requests[cause].priority if cause in self.requests else None,
            # Their LoRA adapters' names, as the scheduler holds them.
            "victim_lora": _lora(request),
            "cause_lora": _lora(self.requests[cause]) if cause in self.requests else None,
        }
        with open(TRUTH, "a") as f:
            f.write(json.dumps(line) + "\n")
        return result

    scheduler.schedule, scheduler.reset_prefix_cache, scheduler._preempt_request = scheduling, resetting, preempting


def _lora(request):
    return request.lora_request.lora_name if request.lora_request is not None else None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if TRUTH:
    sys.meta_path.insert(0, _Finder())
