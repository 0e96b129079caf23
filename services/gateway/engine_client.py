"""The gateway's only link to the scheduler: submit, abort, and per-request token streams.

`EngineClient` is the protocol the HTTP layer uses; `NatsEngineClient` implements it over core
NATS (see `shared.subjects`). Reliability, as DESIGN.md asks:

* the connection retries forever and nats-py restores subscriptions after a reconnect;
* every in-flight request remembers the tokens it received. When the scheduler restarts (a new
  epoch in its heartbeat) or our own NATS connection comes back (deltas sent meanwhile are
  lost), each in-flight request *moves*: the old engine id is dropped and aborted, and the
  request is resubmitted under a fresh id (`<req_id>.<attempt>`) as a continuation carrying
  `output_token_ids`, so the client's stream goes on. A fresh id means a scheduler can never
  see the same id twice, and late deltas of the old id are simply not routed;
* the same happens if NATS reports that it dropped messages for us (slow consumer);
* if no heartbeat arrives for `orphan_timeout` seconds, in-flight streams fail with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from shared.protocol import (
    AbortRequests,
    OutputBatch,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
    decoder,
    encode,
)
from shared.subjects import Subjects

logger = logging.getLogger(__name__)

_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_RETRYABLE = frozenset({429, 503})


class EngineError(Exception):
    """The engine refused or lost a request; `status` is the HTTP status for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RequestStream:
    """Token deltas of one request in arrival order; iteration ends after the finishing delta.

    Iterating raises `EngineError` if the engine lost the request.
    """

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.finished = False
        self._queue: asyncio.Queue[TokenDelta | EngineError] = asyncio.Queue()

    def put(self, delta: TokenDelta) -> None:
        self._queue.put_nowait(delta)

    def fail(self, error: EngineError) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, EngineError):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine (a fake one in unit tests)."""

    @property
    def ready(self) -> bool:
        """True when a scheduler with at least one ready worker is reachable."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """The context length the scheduler announced, if known."""
        ...

    async def submit(self, request: SubmitRequest) -> RequestStream:
        """Submit one request; raises `EngineError` when it is rejected or unanswered."""
        ...

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Abort requests (client gone, stop string hit); unknown ids are ignored."""
        ...


@dataclass
class _InFlight:
    request: SubmitRequest
    stream: RequestStream
    engine_id: str
    output_token_ids: list[int] = field(default_factory=list)
    attempt: int = 0
    accepted: bool = False  # moves only apply to requests a scheduler has accepted


@dataclass
class EngineStats:
    """Counters the metrics module exports."""

    submitted: int = 0
    rejected: int = 0
    aborted: int = 0
    migrated: int = 0
    failed: int = 0


class NatsEngineClient:
    """`EngineClient` over NATS; `start()` returns at once and connects in the background."""

    def __init__(
        self,
        servers: str | list[str],
        *,
        gateway_id: str | None = None,
        subject_prefix: str = "skiff",
        submit_timeout: float = 5.0,
        heartbeat_timeout: float = 3.0,
        orphan_timeout: float = 60.0,
        resubmit_timeout: float = 60.0,
    ) -> None:
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        if not _SUBJECT_TOKEN.fullmatch(self.gateway_id):
            raise ValueError(f"gateway id must match {_SUBJECT_TOKEN.pattern}: {self.gateway_id!r}")
        self.servers = servers
        self.subjects = Subjects(subject_prefix)
        self.submit_timeout = submit_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.orphan_timeout = orphan_timeout
        self.resubmit_timeout = resubmit_timeout
        self.stats = EngineStats()
        self.epoch: str | None = None
        self.num_ready_workers = 0
        self.model = ""
        self._max_model_len: int | None = None
        self._last_heartbeat = float("-inf")
        self._nc: NatsClient | None = None
        self._inflight: dict[str, _InFlight] = {}  # by the gateway's req_id
        self._routes: dict[str, _InFlight] = {}  # by the id the scheduler knows now
        self._tasks: set[asyncio.Task] = set()
        self._migration_pending = asyncio.Event()
        self._migration_round = 0  # counts move-everything events
        self._closing = False
        self._output_decoder = decoder(OutputBatch)
        self._heartbeat_decoder = decoder(SchedulerHeartbeat)
        self._reply_decoder = decoder(SubmitReply)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._spawn(self._connect())
        self._spawn(self._migrator())
        self._spawn(self._watchdog())

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.ready

    async def close(self) -> None:
        """Fail what is still in flight, then drain the NATS connection."""
        self._closing = True
        for record in list(self._inflight.values()):
            record.stream.fail(EngineError(503, "the gateway is shutting down"))
        self._inflight.clear()
        self._routes.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def ready(self) -> bool:
        fresh = time.monotonic() - self._last_heartbeat < self.heartbeat_timeout
        return self.connected and fresh and self.num_ready_workers > 0

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    # ---- EngineClient ---------------------------------------------------------------------

    async def submit(self, request: SubmitRequest) -> RequestStream:
        if not self.connected:
            raise EngineError(503, "the gateway is not connected to NATS")
        if self.epoch is None or not self.ready:
            raise EngineError(503, "no scheduler with ready workers is available")
        if request.req_id in self._inflight:
            raise EngineError(400, f"request id {request.req_id!r} is already in flight")
        request = msgspec.structs.replace(request, gateway_id=self.gateway_id)
        record = _InFlight(request, RequestStream(request.req_id), request.req_id)
        self._inflight[request.req_id] = record
        self._routes[record.engine_id] = record  # before submitting: deltas may beat the reply
        round_at_submit = self._migration_round
        try:
            await self._send_submit(request)
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
            await self._publish_abort(engine_ids)

    # ---- NATS plumbing --------------------------------------------------------------------

    async def _connect(self) -> None:
        try:
            await self._connect_and_subscribe()
        except Exception:
            logger.exception("cannot connect to NATS at %s", self.servers)
            raise

    async def _connect_and_subscribe(self) -> None:
        self._nc = await nats.connect(
            self.servers,
            name=f"skiff-gateway-{self.gateway_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        await self._nc.subscribe(self.subjects.output(self.gateway_id), cb=self._on_output)
        await self._nc.subscribe(self.subjects.scheduler_heartbeat, cb=self._on_heartbeat)
        logger.info("connected to NATS", extra={"gateway_id": self.gateway_id})

    async def _send_submit(self, request: SubmitRequest) -> None:
        """Request-reply on the submit subject; raises EngineError unless accepted."""
        assert self._nc is not None
        try:
            msg = await self._nc.request(
                self.subjects.submit, encode(request), timeout=self.submit_timeout
            )
            reply = self._reply_decoder.decode(msg.data)
        except nats.errors.NoRespondersError:
            raise EngineError(503, "no scheduler is listening") from None
        except (TimeoutError, nats.errors.TimeoutError):
            await self._publish_abort([request.req_id])  # it may have been accepted after all
            raise EngineError(503, "the scheduler did not answer in time") from None
        except (nats.errors.Error, msgspec.DecodeError, OSError) as e:
            raise EngineError(503, f"the scheduler could not be reached: {e}") from None
        if not reply.accepted:
            self.stats.rejected += 1
            raise EngineError(reply.status or 503, reply.message or "request rejected")

    async def _publish_abort(self, engine_ids: list[str]) -> None:
        if self._nc is None:
            return
        try:
            await self._nc.publish(self.subjects.abort, encode(AbortRequests(req_ids=engine_ids)))
        except (nats.errors.Error, OSError) as e:
            logger.warning("abort not sent: %s", e, extra={"req_ids": engine_ids})

    async def _on_output(self, msg: Msg) -> None:
        try:
            batch = self._output_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            logger.error("undecodable output batch: %s", e)
            return
        for delta in batch.deltas:
            record = self._routes.get(delta.req_id)
            if record is None:
                continue  # aborted, finished, or an id we moved away from
            record.output_token_ids.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self._forget(record)
            record.stream.put(delta)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = self._heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            logger.error("undecodable scheduler heartbeat: %s", e)
            return
        self._last_heartbeat = time.monotonic()
        self.num_ready_workers = beat.num_ready_workers
        self.model = beat.model
        self._max_model_len = beat.max_model_len or None
        if beat.epoch != self.epoch:
            if self.epoch is not None:
                logger.warning(
                    "scheduler restarted (epoch %s -> %s); moving %d requests",
                    self.epoch,
                    beat.epoch,
                    len(self._inflight),
                )
                self._request_migration()
            self.epoch = beat.epoch

    async def _on_error(self, e: Exception) -> None:
        if isinstance(e, nats.errors.SlowConsumerError):  # deltas were dropped: move requests
            logger.warning(
                "NATS dropped messages for a slow consumer; moving %d requests", len(self._inflight)
            )
            self._request_migration()
        else:
            logger.debug("NATS error: %s", e)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            logger.warning("disconnected from NATS; reconnecting")

    async def _on_reconnected(self) -> None:
        logger.warning("reconnected to NATS; moving %d in-flight requests", len(self._inflight))
        self._request_migration()

    # ---- moving requests ------------------------------------------------------------------

    def _request_migration(self) -> None:
        self._migration_round += 1
        self._migration_pending.set()

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
        await self._publish_abort([old_id])
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
                await self._send_submit(continuation)
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
            silent = time.monotonic() - self._last_heartbeat
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
