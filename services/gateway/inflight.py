"""The gateway's in-flight requests: placing them on scheduler shards, routing deltas to their
streams, and moving requests whose deltas may have been lost.

A new request goes to the available shard `Shards.route` picks (by prompt prefix, else load); a
shard that answers 429 hands it to the next one, once. While no shard is available, or they
answer 503 (not ready, gone), it waits for the next heartbeat and tries again, for up to
`resubmit_timeout`: a scheduler that restarts or hands over to the next one delays new requests,
it does not fail them. Every in-flight request remembers its shard and the tokens it received.
When its shard's scheduler restarts (new epoch), or for every request when our own NATS
connection comes back or NATS drops messages for us, a request accepted by a shard *moves*: its
engine id is dropped and aborted on its shard, and it is resubmitted to the shard `Shards.route`
picks under a fresh id (`<req_id>.<attempt>`, fresh for every try) as a continuation carrying
`output_token_ids`, so the client's stream goes on. A fresh id means no scheduler ever sees the
same id twice and no request is held by two shards: late deltas of an old id are simply not
routed. A shard whose scheduler announces that it is leaving moves its requests at once. If a
shard sends no heartbeat for `orphan_timeout` seconds, the streams of its requests fail with
503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from services.gateway.nats_transport import NatsTransport
from services.gateway.request_stream import EngineError, RequestStream
from shared.tasks import BackgroundTasks
from shared.wire import OutputBatch, SubmitRequest

logger = logging.getLogger(__name__)

_RETRYABLE = frozenset({429, 503})
# A request the scheduler failed (finish reason "error"): it was in the steps of workers that
# stalled or were lost, as many times as the scheduler allows. 422, not 503: the failure
# follows the request's content, so retrying it as it is would only take down more workers,
# and clients retry a 503 on their own (the OpenAI SDKs do), never a 422.
FAILED_REQUEST_STATUS = 422


@dataclass
class EngineStats:
    """Counters the metrics module exports: requests accepted on first submit, rejections
    (every 'no' from a shard), client aborts, moves accepted, and streams failed."""

    submitted: int = 0
    rejected: int = 0
    aborted: int = 0
    migrated: int = 0
    failed: int = 0


class _Rejected(EngineError):
    """A shard answered no: it does not hold the request."""


@dataclass
class _InFlight:
    request: SubmitRequest
    stream: RequestStream
    engine_id: str
    shard: int  # the shard `engine_id` was last sent to
    output_token_ids: list[int] = field(default_factory=list)
    attempt: int = 0
    accepted: bool = False  # moves only apply to requests a shard has accepted
    lost: bool = False  # deltas may have been lost since it was last sent
    moving: bool = False


class InFlightRequests:
    """Requests by the gateway's id and by the id a scheduler knows now."""

    def __init__(
        self, transport: NatsTransport, *, orphan_timeout: float, resubmit_timeout: float
    ) -> None:
        self.transport = transport
        self.shards = transport.shards
        self.orphan_timeout = orphan_timeout
        self.resubmit_timeout = resubmit_timeout
        self.stats = EngineStats()
        self._inflight: dict[str, _InFlight] = {}  # by the gateway's req_id
        self._routes: dict[str, _InFlight] = {}  # by the id a scheduler knows now
        self._tasks = BackgroundTasks("gateway-inflight")  # the watchdog and moves

    def __len__(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        self._tasks.spawn(self._watchdog(), "watchdog")

    def close(self, error: EngineError) -> None:
        """Fail every stream with `error` and stop moving requests."""
        for record in list(self._inflight.values()):
            record.stream.fail(error)
        self._inflight.clear()
        self._routes.clear()
        self._tasks.cancel()

    async def submit(self, request: SubmitRequest) -> RequestStream:
        if request.req_id in self._inflight:
            raise EngineError(400, f"request id {request.req_id!r} is already in flight")
        shard = self.shards.choose(lora_name=request.lora_name)
        record = _InFlight(request, RequestStream(request.req_id), request.req_id, shard or 0)
        self._inflight[request.req_id] = record
        self._routes[record.engine_id] = record  # before submitting: deltas may beat the reply
        try:
            await self._place(record)
        except EngineError:
            self._forget(record)
            raise
        record.accepted = True
        self.stats.submitted += 1
        if record.lost:  # accepted by a scheduler now gone, or deltas lost meanwhile?
            self._start_move(record)
        return record.stream

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Forget the requests and abort them on the shards that hold them."""
        by_shard: dict[int, list[str]] = defaultdict(list)
        for req_id in req_ids:
            record = self._inflight.get(req_id)
            if record is not None:
                self._forget(record)
                by_shard[record.shard].append(record.engine_id)
        for shard, engine_ids in by_shard.items():
            self.stats.aborted += len(engine_ids)
            await self.transport.abort(shard, engine_ids)

    async def deliver(self, batch: OutputBatch) -> None:
        """Route each delta to its stream by the engine id it was sent under; a request the
        scheduler failed fails its stream with FAILED_REQUEST_STATUS."""
        for delta in batch.deltas:
            record = self._routes.get(delta.req_id)
            if record is None:
                continue  # aborted, finished, or an id we moved away from
            if delta.finish_reason == "error":
                error = delta.error or "the request failed"
                self._fail(record, EngineError(FAILED_REQUEST_STATUS, error))
                continue
            record.output_token_ids.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self._forget(record)
            record.stream.put(delta)

    def move(self, reason: str, shard: int | None = None) -> None:
        """Deltas of the requests on `shard` (on every shard when None) may have been lost:
        move them, in the background, as soon as a shard has accepted them."""
        records = [r for r in self._inflight.values() if shard is None or r.shard == shard]
        logger.warning("%s; moving %d in-flight requests", reason, len(records))
        for record in records:
            record.lost = True
            if record.accepted:
                self._start_move(record)

    def fail_orphans(self) -> None:
        """Fail the requests of every shard silent for `orphan_timeout`."""
        silent = {i for i, s in enumerate(self.shards) if s.heartbeat_age > self.orphan_timeout}
        orphans = [r for r in self._inflight.values() if r.shard in silent]
        if orphans:
            logger.error(
                "no heartbeat from scheduler shards %s for %.0f s; failing %d requests",
                sorted(silent),
                self.orphan_timeout,
                len(orphans),
            )
        for record in orphans:
            self._fail(record, EngineError(503, "lost contact with the scheduler"))

    def _choose(self, token_ids: list[int], lora_name: str | None) -> int:
        route = self.shards.route(token_ids=token_ids, lora_name=lora_name)
        if route is None:
            raise EngineError(503, "no scheduler with ready workers is available")
        self.shards.count(route)
        return route.shard

    async def _place(self, record: _InFlight) -> None:
        """First submit: to the available shard `Shards.route` picks; after a 429, once to
        another one; while none is available or they answer 503, again after the next
        heartbeat, until `resubmit_timeout`."""
        deadline = time.monotonic() + self.resubmit_timeout
        error = EngineError(503, "no scheduler with ready workers is available")
        unavailable: set[int] = set()  # answered 503 since the last heartbeat
        handed_over = False
        while self._holds(record):
            route = self.shards.route(
                unavailable, record.request.prompt_token_ids, record.request.lora_name
            )
            if route is None:
                if not await self.shards.wait_for_change(deadline):
                    raise error
                unavailable.clear()
                continue
            shard = route.shard
            self.shards.count(route)
            try:
                await self._send(record, record.request, shard)
                return
            except EngineError as e:
                other = self.shards.choose(exclude={shard}, lora_name=record.request.lora_name)
                if e.status == 429 and not handed_over and other is not None:
                    handed_over = True
                elif e.status != 503:
                    raise
                error = e
                unavailable.add(shard)
        raise EngineError(503, "the request was aborted")

    async def _send(self, record: _InFlight, request: SubmitRequest, shard: int) -> None:
        """Submit `request` (the record's engine id) to `shard`; raises `EngineError`."""
        record.shard, record.lost = shard, False
        self.shards[shard].submitted += 1
        reply = await self.transport.submit(shard, request)
        if not reply.accepted:
            self.stats.rejected += 1
            raise _Rejected(reply.status or 503, reply.message or "request rejected", reply.param)

    def _start_move(self, record: _InFlight) -> None:
        if not record.moving:
            record.moving = True
            self._tasks.spawn(self._move(record), f"move {record.request.req_id}")

    async def _move(self, record: _InFlight) -> None:
        """Resubmit until the record is held by a shard that has lost none of its deltas."""
        try:
            while record.lost and self._holds(record):
                await self._resubmit(record)
        finally:
            record.moving = False

    async def _resubmit(self, record: _InFlight) -> None:
        """Drop and abort the record's engine id, then submit it as a continuation to the shard
        `Shards.route` picks for its tokens so far; retry while overloaded (429/503) for up to
        `resubmit_timeout`."""
        self._routes.pop(record.engine_id, None)
        await self.transport.abort(record.shard, [record.engine_id])
        deadline = time.monotonic() + self.resubmit_timeout
        delay = 0.1
        while self._holds(record):
            try:
                shard = self._choose(
                    record.request.prompt_token_ids + record.output_token_ids,
                    record.request.lora_name,
                )
                await self._send(record, self._continuation(record), shard)
                self.stats.migrated += 1
                return
            except EngineError as e:
                if e.status not in _RETRYABLE or time.monotonic() + delay > deadline:
                    self._fail(record, e)
                    return
            await self.shards.wait_for_change(time.monotonic() + delay)  # or a new scheduler
            delay = min(delay * 2, 2.0)

    def _continuation(self, record: _InFlight) -> SubmitRequest:
        """The record under its next engine id, carrying the tokens streamed so far."""
        self._routes.pop(record.engine_id, None)
        record.attempt += 1
        record.engine_id = f"{record.request.req_id}.{record.attempt}"
        self._routes[record.engine_id] = record
        params = msgspec.structs.replace(record.request.sampling_params, prompt_logprobs=None)
        return msgspec.structs.replace(
            record.request,
            req_id=record.engine_id,
            sampling_params=params,
            output_token_ids=list(record.output_token_ids),
        )

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.orphan_timeout / 4))
            self.fail_orphans()

    def _holds(self, record: _InFlight) -> bool:
        return self._inflight.get(record.request.req_id) is record

    def _fail(self, record: _InFlight, error: EngineError) -> None:
        self.stats.failed += 1
        self._forget(record)
        record.stream.fail(error)

    def _forget(self, record: _InFlight) -> None:
        self._inflight.pop(record.request.req_id, None)
        self._routes.pop(record.engine_id, None)
