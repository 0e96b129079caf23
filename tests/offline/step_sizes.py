"""Counting the requests of each step an offline engine runs."""

from __future__ import annotations

from services.offline import LLM
from shared.wire import BatchPlan, ModelRunnerOutput


def record_step_sizes(llm: LLM) -> list[int]:
    """Wraps `llm`'s step execution: the returned list gets each step's number of requests."""
    sizes: list[int] = []
    execute = llm._execute

    def counted(plan: BatchPlan) -> ModelRunnerOutput:
        sizes.append(len(plan.num_scheduled_tokens))
        return execute(plan)

    llm._execute = counted  # type: ignore[method-assign]
    return sizes
