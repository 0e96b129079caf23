"""Whether a submission is accepted: not while leaving or without healthy workers, not beyond the
queue limit, not twice, with a priority only under the "priority" scheduling policy, and only
within the rules of `shared.sampling_params`."""

from __future__ import annotations

from services.scheduler.lora_registry import LoRARegistry
from services.scheduler.placement import Placement
from services.scheduler.worker_pool import WorkerPool
from shared.sampling_params import (
    SamplingParamsError,
    check_prompt_fits,
    validate_sampling_params,
)
from shared.wire import SubmitReply, SubmitRequest


class Admission:
    """Answers each `SubmitRequest` with the reply the gateway gets; `leaving` refuses all."""

    def __init__(
        self,
        pool: WorkerPool,
        placement: Placement,
        max_waiting: int,
        loras: LoRARegistry | None = None,
    ) -> None:
        """`loras`: the adapters requests may name (None: none)."""
        self.pool = pool
        self.placement = placement
        self.max_waiting = max_waiting
        self.loras = loras if loras is not None else LoRARegistry({})
        self.leaving = False

    def check(self, sub: SubmitRequest) -> SubmitReply:
        if self.leaving:
            return _reject(503, "scheduler is shutting down")
        if not self.pool.num_healthy:
            return _reject(503, "no worker is ready")
        if self.pool.num_waiting >= self.max_waiting:
            return _reject(429, "the request queue is full")
        if sub.req_id in self.placement:
            return _reject(400, "duplicate request id")
        if sub.lora_name is not None:
            if sub.lora_name not in self.loras:
                message = f"The model `{sub.lora_name}` does not exist."
                return _reject(404, message, param="model")
            if not any(w.healthy and w.hello.max_loras for w in self.pool.workers.values()):
                return _reject(503, "no worker with LoRA adapters (--enable-lora) is ready")
        if sub.priority != 0 and self.pool.config.scheduling_policy != "priority":
            message = f"Got priority {sub.priority} but Priority scheduling is not enabled."
            return _reject(400, message, param="priority")
        try:
            validate_sampling_params(sub.sampling_params, self.pool.vocab_size)
        except SamplingParamsError as exc:
            return _reject(400, f"{exc.param}: {exc.message}")
        try:
            # tokens already streamed (a continuation) are context too
            num_tokens = len(sub.prompt_token_ids) + len(sub.output_token_ids)
            check_prompt_fits(num_tokens, self.pool.max_model_len)
            check_prompt_fits(len(sub.prompt_token_ids), self.pool.max_model_len)  # not empty
        except SamplingParamsError as exc:
            return _reject(400, exc.message)
        return SubmitReply(accepted=True)


def _reject(status: int, message: str, param: str | None = None) -> SubmitReply:
    return SubmitReply(accepted=False, status=status, message=message, param=param)
