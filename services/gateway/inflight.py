"""The gateway's in-flight requests: routing deltas to their streams, and moving requests whose
deltas may have been lost.

Every in-flight request remembers the tokens it received. When the scheduler restarts, our own
NATS connection comes back, or NATS drops messages for us, each accepted request *moves*: the
old engine id is dropped and aborted, and the request is resubmitted under a fresh id
(`<req_id>.<attempt>`) as a continuation carrying `output_token_ids`, so the client's stream
goes on. A fresh id means a scheduler never sees the same id twice, and late deltas of the old
id are simply not routed. If no heartbeat arrives for `orphan_timeout` seconds, in-flight
streams fail with 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.nats_transport import NatsTransport
from services.gateway.request_stream import EngineError, RequestStream
from shared.protocol import OutputBatch, SubmitRequest

logger = logging.getLogger(__name__)

_RETRYABLE = frozenset({429, 503})


@dataclass
class EngineStats:
    """Counters the metrics module exports."""

    submitted: int = 0
    rejected: int = 0
    aborted: int = 0
    migrated: int = 0
    failed: int = 0


@dataclass
class _InFlight:
    request: SubmitRequest
    stream: RequestStream
    engine_id: str
    output_token_ids: list[int] = field(default_factory=list)
    attempt: int = 0
    accepted: bool = False  # moves only apply to requests a scheduler has accepted


class InFlightRequests:
    """Requests by the gateway's id and by the id the scheduler knows now."""

    def __init__(
        self, transport: NatsTransport, *, orphan_timeout: float, resubmit_timeout: float
    ) -> None:
        self.transport = transport
        self.orphan_timeout = orphan_timeout
        self.resubmit_timeout = resubmit_timeout
        self.stats = EngineStats()
        self._inflight: dict[str, _InFlight] = {}  # by the gateway's req_id
        self._routes: dict[str, _InFlight] = {}  # by the id the scheduler knows now
        self._tasks: set[asyncio.Task[None]] = set()
        self._migration_pending = asyncio.Event()
        self._migration_round = 0  # counts move-everything events

    def __len__(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        self._spawn(self._migrator())
        self._spawn(self._watchdog())

    def close(self, error: EngineError) -> None:
        """Fail every stream with `error` and stop moving requests."""
        for record in list(self._inflight.values()):
            record.stream.fail(error)
        self._inflight.clear()
        self._routes.clear()
        for task in list(self._tasks):
            task.cancel()

    async def submit(self, request: SubmitRequest) -> RequestStream:
        if request.req_id in self._inflight:
            raise EngineError(400, f"request id {request.req_id!r} is already in flight")
        record = _InFlight(request, RequestStream(request.req_id), request.req_id)
        self._inflight[request.req_id] = record
        self._routes[record.engine_id] = record  # before submitting: deltas may beat the reply
        round_at_submit = self._migration_round
        try:
            await self._send(request)
        except EngineError:
            self._forget(record)
            raise
        record.accepted = True
        self.stats.submitted += 1
        if self._migration_round != round_at_submit:  # accepted by a scheduler now gone?
            self._spawn(self._move(record))
        return record.stream

    async def abort(self, req_ids: Sequence[str]) -> None:
        engine_ids = []
        for req_id in req_ids:
            record = self._inflight.get(req_id)
            if record is not None:
                self._forget(record)
                engine_ids.append(record.engine_id)
        if engine_ids:
            self.stats.aborted += len(engine_ids)
            await self.transport.abort(engine_ids)

    async def deliver(self, batch: OutputBatch) -> None:
        """Route each delta to its stream by the engine id it was sent under."""
        for delta in batch.deltas:
            record = self._routes.get(delta.req_id)
            if record is None:
                continue  # aborted, finished, or an id we moved away from
            record.output_token_ids.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self._forget(record)
            record.stream.put(delta)

    def move_all(self, reason: str) -> None:
        """Deltas may have been lost: move every accepted request (in the background)."""
        logger.warning("%s; moving %d in-flight requests", reason, len(self._inflight))
        self._migration_round += 1
        self._migration_pending.set()

    async def _send(self, request: SubmitRequest) -> None:
        reply = await self.transport.submit(request)
        if not reply.accepted:
            self.stats.rejected += 1
            raise EngineError(reply.status or 503, reply.message or "request rejected")

    async def _migrator(self) -> None:
        while True:
            await self._migration_pending.wait()
            self._migration_pending.clear()
            records = [r for r in self._inflight.values() if r.accepted]
            await asyncio.gather(*(self._move(r) for r in records))

    async def _move(self, record: _InFlight) -> None:
        """Resubmit a request as a continuation under a fresh id; retry while overloaded."""
        old_id = record.engine_id
        record.attempt += 1
        record.engine_id = f"{record.request.req_id}.{record.attempt}"
        self._routes.pop(old_id, None)
        self._routes[record.engine_id] = record
        await self.transport.abort([old_id])
        params = msgspec.structs.replace(record.request.sampling_params, prompt_logprobs=None)
        continuation = msgspec.structs.replace(
            record.request,
            req_id=record.engine_id,
            sampling_params=params,
            output_token_ids=list(record.output_token_ids),
        )
        deadline = time.monotonic() + self.resubmit_timeout
        delay = 0.1
        while self._inflight.get(record.request.req_id) is record:
            if self._migration_pending.is_set():
                return  # a newer move of every request is coming
            try:
                await self._send(continuation)
                self.stats.migrated += 1
                return
            except EngineError as e:
                if e.status not in _RETRYABLE or time.monotonic() + delay > deadline:
                    self._fail(record, e)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            silent = self.transport.heartbeat_age
            if self._inflight and silent > self.orphan_timeout:
                logger.error(
                    "no scheduler heartbeat for %.0f s; failing %d requests",
                    silent,
                    len(self._inflight),
                )
                for record in list(self._inflight.values()):
                    self._fail(record, EngineError(503, "lost contact with the scheduler"))

    def _fail(self, record: _InFlight, error: EngineError) -> None:
        self.stats.failed += 1
        self._forget(record)
        record.stream.fail(error)

    def _forget(self, record: _InFlight) -> None:
        self._inflight.pop(record.request.req_id, None)
        self._routes.pop(record.engine_id, None)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
