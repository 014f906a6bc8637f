"""A vLLM-v1-like scheduler: token budget, chunked prefill, recompute preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCache
from .request import Request, RequestStatus

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    started: list[Request] = field(default_factory=list)  # moved from waiting to running
    # (request, tokens lost, the request whose allocation it served: the victim itself, last)
    preempted: list[tuple[Request, int, Request]] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    """Each step: serve running requests oldest first, then admit waiting ones in FIFO order.

    A request's need this step is ``num_tokens - num_computed_tokens`` (a whole or partial
    prefill, or one decode token), capped by what is left of the step's token budget. When a
    running request needs a block and none is free, the most recently scheduled running request
    is preempted (recompute: its blocks and computed tokens are dropped, its output is kept and it
    goes to the front of the waiting queue), until the allocation fits or the request has
    preempted itself. The cause of each preemption is the request being allocated. No waiting
    request is admitted in a step that preempted.

    ``policy`` "priority" (vLLM's ``--scheduling-policy priority``): waiting requests are admitted
    by (priority, arrival), lower first, and the victim is the running request with the highest
    (priority, arrival), even one already scheduled in this step (its scheduling is undone).
    """

    def __init__(self, kv_cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs") -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens ({max_num_batched_tokens}) must be >= 1"
            )
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of {POLICIES}")
        self.policy = policy
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.num_preemptions = 0  # since start, over all requests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_new
            while not self.kv_cache.allocate(request.block_table, target):
                position = self._victim_position()
                victim = self.running.pop(position)
                if position < index:  # scheduled earlier in this step: undone
                    [entry] = [e for e in out.scheduled if e[0] is victim]
                    out.scheduled.remove(entry)
                    budget += entry[1]
                    index -= 1
                out.preempted.append((victim, self._preempt(victim, request), request))
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # preempted itself: everything after it is gone too
            out.scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self._head()
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self.kv_cache.allocate(request.block_table, num_new):
                    break  # in order: nobody overtakes the head
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.started.append(request)
                out.scheduled.append((request, num_new))
                budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _victim_position(self) -> int:
        """Where in ``running`` the next victim is: the last one (fcfs), or the highest
        (priority, arrival) (priority policy, vLLM's rule)."""
        if self.policy == "fcfs":
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda i: (self.running[i].priority, self.running[i].arrival_time))

    def _head(self) -> Request:
        if self.policy == "fcfs":
            return self.waiting[0]
        return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request, cause: Request) -> int:
        request.preempted_by.append(cause.request_id)
        cause.num_preemptions_caused += 1
        lost = request.num_computed_tokens
        self.kv_cache.free(request.block_table)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return lost

    def finish(self, request: Request, reason: str) -> None:
        """Remove a running or waiting request for good and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv_cache.free(request.block_table)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
