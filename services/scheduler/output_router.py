"""Where each request's tokens go: the gateway that submitted it, one `OutputBatch` per gateway
and step."""

from __future__ import annotations

from collections import defaultdict

from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_driver import Publish
from shared.subjects import Subjects
from shared.wire import OutputBatch, TokenDelta


class OutputRouter:
    def __init__(self, publish: Publish, subjects: Subjects) -> None:
        self._publish = publish
        self._subjects = subjects
        self.gateway_of: dict[str, str] = {}  # req_id -> gateway id

    def add(self, req_id: str, gateway_id: str) -> None:
        self.gateway_of[req_id] = gateway_id

    def forget(self, req_id: str) -> None:
        self.gateway_of.pop(req_id, None)

    def requests_of(self, gateway_id: str) -> list[str]:
        return [r for r, g in self.gateway_of.items() if g == gateway_id]

    async def fail(self, req_id: str, error: str) -> None:
        """End the request with finish reason "error" and `error` for its client."""
        gateway = self.gateway_of.pop(req_id, None)
        if gateway is not None:
            delta = TokenDelta(req_id=req_id, finish_reason="error", error=error)
            await self._publish(self._subjects.output(gateway), OutputBatch(deltas=[delta]))

    async def publish(self, outputs: list[RequestOutput]) -> None:
        """Send each output to its request's gateway; a finished request is forgotten."""
        by_gateway: dict[str, list[TokenDelta]] = defaultdict(list)
        for out in outputs:
            gateway = self.gateway_of.get(out.req_id)
            if gateway is None:
                continue
            by_gateway[gateway].append(
                TokenDelta(
                    req_id=out.req_id,
                    new_token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason.value if out.finish_reason else None,
                    stop_token_id=out.stop_token_id,
                    num_cached_tokens=out.num_cached_tokens,
                    logprobs=out.logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                    error=out.error,
                )
            )
            if out.finish_reason is not None:
                del self.gateway_of[out.req_id]
        for gateway, deltas in by_gateway.items():
            batch = OutputBatch(deltas=deltas)
            await self._publish(self._subjects.output(gateway), batch)
