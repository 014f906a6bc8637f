"""A request's state inside the engine, and the output handed back when it finishes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from .model import STOP_TOKEN_ID


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset({STOP_TOKEN_ID})
    generator: Optional[torch.Generator] = None  # seeded per request: sampling ignores batching
    trace_context: Optional[Mapping[str, str]] = None
    priority: int = 0  # lower is served first under the priority policy, as in vLLM
    lora: Optional[str] = None  # the LoRA adapter it names (a label here: the stub has no adapters)
    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by the output so far: what a recompute after preemption must prefill
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # The engine's own record of why: the request whose block allocation each preemption served
    # (its own id when it preempted itself), and the preemptions this one's allocations caused.
    preempted_by: list[str] = field(default_factory=list)
    num_preemptions_caused: int = 0
    finish_reason: Optional[str] = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # output tokens, a stop token included
    finish_reason: str  # "stop", "length" or "abort"
    num_preemptions: int  # the engine's ground truth
    preempted_by: tuple[str, ...] = ()  # the cause of each preemption, in order (ground truth)
    num_preemptions_caused: int = 0  # preemptions its block allocations caused (ground truth)

    @property
    def text(self) -> str:
        return decode(self.token_ids)


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))
