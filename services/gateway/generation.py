"""Running the choices of one HTTP request against the engine.

`Generation.start()` submits every choice (all or nothing: if one is rejected the others are
aborted and the rejection becomes the HTTP error). `Generation.updates()` then yields
`ChoiceUpdate`s of all choices as they come. Whatever way iteration ends (finished, stop string,
client gone, error), unfinished engine requests are aborted; aborts are sent from a detached
task so that they go out even from a cancelled scope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from services.gateway.choice import ChoiceSpec, ChoiceState, ChoiceUpdate
from services.gateway.engine_client import EngineClient, EngineError, RequestStream
from services.gateway.errors import APIError
from services.gateway.metrics import ChoiceTimer, GatewayMetrics, ModelMetrics
from services.gateway.tracing import ChoiceSpans
from shared import tracing
from shared.tasks import BackgroundTasks
from shared.tokenizer import Tokenizer
from shared.wire import SubmitRequest

logger = logging.getLogger(__name__)

_aborts = BackgroundTasks("gateway-aborts")


def abort_soon(engine: EngineClient, req_ids: Sequence[str]) -> None:
    """Send an abort without awaiting it (safe inside cancelled scopes and finally blocks)."""
    if not req_ids:
        return
    _aborts.spawn(engine.abort(list(req_ids)), "abort")


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        model_metrics: ModelMetrics,
        specs: list[ChoiceSpec],
        arrival: float | None = None,
        priority: int = 0,
        on_tokens: Callable[[int], None] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """`priority`: every choice's scheduling priority (lower first, as in vLLM);
        `on_tokens`: called with the number of tokens of each update (the tenant's count);
        `lora_name`: the LoRA adapter every choice runs with (None: the base model)."""
        self.engine = engine
        self.model = lora_name  # the adapter responses name as their model
        self.priority = priority
        self.on_tokens = on_tokens
        self.metrics = metrics
        self.choices = [ChoiceState(spec, tokenizer) for spec in specs]
        arrival = time.monotonic() if arrival is None else arrival
        self.timers = [ChoiceTimer(model_metrics, arrival, len(s.prompt_ids)) for s in specs]
        self._streams: list[RequestStream] = []
        self._spans = ChoiceSpans(tracing.tracer, specs) if tracing.tracer else None

    async def start(self, gateway_id: str = "") -> None:
        """Submit all choices; raise APIError (after aborting the accepted ones) on rejection."""
        requests = [
            SubmitRequest(
                req_id=c.spec.req_id,
                gateway_id=gateway_id,
                prompt_token_ids=c.spec.prompt_ids,
                sampling_params=c.spec.params,
                priority=self.priority,
                traceparent=self._spans.traceparent(i) if self._spans else None,
                lora_name=self.model,
            )
            for i, c in enumerate(self.choices)
        ]
        started = time.monotonic()
        try:
            results = await asyncio.gather(
                *(self.engine.submit(r) for r in requests), return_exceptions=True
            )
        except asyncio.CancelledError:  # the server is going away mid-submit
            abort_soon(self.engine, [r.req_id for r in requests])
            raise
        self.metrics.submit_seconds.observe(time.monotonic() - started)
        streams = [r for r in results if isinstance(r, RequestStream)]
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            abort_soon(self.engine, [s.req_id for s in streams])
            if self._spans is not None:
                self._spans.end(self.choices, type(error).__name__)
            if isinstance(error, EngineError):
                raise APIError(error.status, error.message, error.param)
            raise error
        self._streams = streams
        self.metrics.in_flight.inc()
        logger.info(
            "submitted %d choice(s)",
            len(streams),
            extra={"engine_req_ids": [s.req_id for s in streams]},
        )

    async def updates(
        self, idle_timeout: float | None = None
    ) -> AsyncIterator[ChoiceUpdate | None]:
        """Updates of all choices, interleaved; raises APIError if the engine loses one. With
        `idle_timeout`, None is yielded whenever no update came for that long."""
        queue: asyncio.Queue[ChoiceUpdate | EngineError] = asyncio.Queue()
        pumps = BackgroundTasks("generation")
        for c, s, t in zip(self.choices, self._streams, self.timers, strict=True):
            pumps.spawn(self._pump(c, s, t, queue), f"pump {c.spec.req_id}")
        try:
            remaining = len(self._streams)
            while remaining:
                try:
                    item = await asyncio.wait_for(queue.get(), idle_timeout)
                except TimeoutError:
                    yield None
                    continue
                if isinstance(item, EngineError):
                    raise APIError(item.status, item.message)
                remaining -= item.finish_reason is not None
                yield item
        finally:
            pumps.cancel()
            self._cleanup()

    async def _pump(
        self,
        choice: ChoiceState,
        stream: RequestStream,
        timer: ChoiceTimer,
        queue: asyncio.Queue[ChoiceUpdate | EngineError],
    ) -> None:
        try:
            async for delta in stream:
                if self._spans is None:
                    update = choice.process(delta)
                else:
                    update = self._spans.process(choice, delta)
                timer.tokens(len(update.token_ids))
                if self.on_tokens is not None:
                    self.on_tokens(len(update.token_ids))
                queue.put_nowait(update)
                if choice.finished:
                    break
        except EngineError as e:
            logger.warning("engine lost request %s: %s", choice.spec.req_id, e.message)
            queue.put_nowait(e)
            return
        except Exception:  # a gateway bug: fail this response instead of hanging it
            logger.exception("failed to process output of %s", choice.spec.req_id)
            queue.put_nowait(EngineError(500, "internal error while processing the output"))
            return
        if not choice.finished:  # the stream ended without a finish reason: treat as aborted
            queue.put_nowait(choice.abort())
        if choice.stopped_by_string:
            self.metrics.stop_string_aborts.inc()
            abort_soon(self.engine, [choice.spec.req_id])
        timer.finish(choice.finish_reason or "abort")

    def _cleanup(self) -> None:
        """Abort what is unfinished (client gone or error) and settle the metrics once."""
        if not self._streams:
            return
        unfinished = [c for c in self.choices if not c.finished]
        if unfinished:
            abort_soon(self.engine, [c.spec.req_id for c in unfinished])
        for choice, timer in zip(self.choices, self.timers, strict=True):
            if not choice.finished:
                choice.abort()
                timer.finish("abort")
        self.metrics.in_flight.dec()
        self._streams = []
        if self._spans is not None:
            self._spans.end(self.choices)

    def close(self) -> None:
        """Abort everything if `updates()` never ran (e.g. the client left before it began)."""
        self._cleanup()
