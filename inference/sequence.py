"""A request's token sequence and its progress through the engine (torch-free bookkeeping).

The engine keeps every request as a :class:`Sequence`: prompt and generated tokens in one list, how
many of them already have keys and values in the paged cache (``num_computed_tokens``), and the blocks
that hold them (``block_table``). Prefill and decode are the same operation here: each step computes
some of the not-yet-computed tokens, and a token is sampled once all tokens are computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inference.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the device failed under it


@dataclass(slots=True)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, in order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while prompt tokens (or tokens to recompute after preemption) remain beyond the last one."""
        return self.num_uncomputed_tokens > 1

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.seq_id)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Forget cached state after preemption; generated tokens stay and are recomputed as prompt."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
