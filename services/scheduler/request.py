"""Scheduler-side request state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from shared.prefix_hash import prefix_root
from shared.sampling_params import SamplingParams
from shared.wire import LoRARequest

if TYPE_CHECKING:
    from services.scheduler.handoff import Handoff


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is being loaded from a lower KV tier
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"  # failed by the scheduler: it stalled or lost the workers that ran it


class Request:
    """One sequence: prompt, generated tokens and how much of it is in the KV cache."""

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        output_token_ids: list[int] | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids = prompt_token_ids + self.output_token_ids
        self.priority = priority
        self.lora = lora  # the LoRA adapter it runs with; None: the base model
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by plans still in flight: scheduled as if known, appended on arrival.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        # Its prefix loaded from lower KV tiers since it was last admitted (Scheduler)
        self.num_prefix_loads = 0
        self.num_loaded_tokens = 0  # prefix tokens those loads brought back
        # Stalls and lost workers while a step of it was in flight, over its placements
        self.num_failures = 0
        # Disaggregation (handoff.py): prefilled here, then handed to a decode worker once its
        # first token is sampled; or, on the decode worker, on its way from the prefill worker.
        self.prefill_only = False
        self.handoff: Handoff | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.lora_name

    @property
    def prefix_root(self) -> bytes:
        """The parent hash of its first KV block (the base model's or its adapter's)."""
        return prefix_root(self.lora_name)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def successor(self) -> Request:
        """A new request with this one's tokens so far, parameters and arrival time, to go on
        on another worker (its KV cache is that worker's to compute or fetch)."""
        moved = Request(
            self.req_id,
            self.prompt_token_ids,
            self.sampling_params,
            output_token_ids=self.output_token_ids,
            priority=self.priority,
            lora=self.lora,
        )
        moved.arrival_time = self.arrival_time
        moved.num_failures = self.num_failures
        return moved

    def append_output_token(self, token_id: int) -> None:
        """Append a sampled token; it fills a placeholder if one is outstanding."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_output_placeholders:
            self.num_output_placeholders -= 1

    def __repr__(self) -> str:
        progress = f"{self.num_computed_tokens}/{self.num_tokens}"
        return f"Request({self.req_id}, {self.status.value}, computed={progress})"
