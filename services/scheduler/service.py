"""The scheduler service: NATS in and out, one step loop per worker.

Accepts submissions (request-reply), aborts, worker hellos/heartbeats and results; drives
each worker with plan -> result -> next plan; streams token deltas to the submitting gateway;
re-places the requests of a worker that stopped heart-beating on the live ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict

import msgspec
from nats.aio.msg import Msg

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared import bus
from shared.config import SchedulerConfig, SchedulerServiceConfig
from shared.protocol import (
    AbortRequests,
    ModelRunnerOutput,
    OutputBatch,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
    WorkerHello,
    decoder,
    encode,
)
from shared.sampling_params import SamplingParamsError, validate_sampling_params
from shared.subjects import Subjects

log = logging.getLogger("skiff.scheduler")


def context_length_error(max_len: int, num_prompt: int, max_tokens: int | None) -> str:
    requested = num_prompt + (max_tokens or 0)
    return (
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{requested} tokens ({num_prompt} in the messages, {max_tokens or 0} in the "
        "completion). Please reduce the length of the messages or completion."
    )


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig, scheduler_config: SchedulerConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.subject_prefix)
        self.epoch = uuid.uuid4().hex
        self.pool = WorkerPool(scheduler_config)
        self.placement: dict[str, WorkerHandle] = {}  # req_id -> worker
        self.gateway_of: dict[str, str] = {}  # req_id -> gateway id
        self.unplaced: list[Request] = []  # waiting for any worker to come (back)
        self.loops: dict[str, asyncio.Task] = {}
        self.wakeups: dict[str, asyncio.Event] = {}
        self.pending: dict[tuple[str, int], asyncio.Future] = {}
        self.metrics = SchedulerMetrics(config.model_name)
        self.draining = False
        self._dec = {
            cls: decoder(cls)
            for cls in (SubmitRequest, AbortRequests, WorkerHello, ModelRunnerOutput)
        }
        self._tasks: list[asyncio.Task] = []
        self._counted: dict = {}

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.nc = await bus.connect(self.config.nats_url, "skiff-scheduler", self._on_reconnect)
        s = self.subjects
        await self.nc.subscribe(s.submit, cb=self._on_submit)
        await bus.subscribe(self.nc, s.abort, self._on_abort)
        await bus.subscribe(self.nc, s.worker_hello, self._on_hello)
        await bus.subscribe(self.nc, s.worker_heartbeat, self._on_hello)
        await bus.subscribe(self.nc, s.result, self._on_result)
        await self.nc.subscribe(s.scheduler_stats, cb=self._on_stats)
        self._tasks.append(asyncio.create_task(self._monitor()))
        log.info("scheduler up, epoch %s", self.epoch)

    async def drain(self) -> None:
        """Refuse new work, let running requests finish (bounded), then stop."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.placement and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.stop()

    async def stop(self) -> None:
        for task in [*self._tasks, *self.loops.values()]:
            task.cancel()
        await self.nc.drain()

    async def _on_reconnect(self) -> None:
        """A plan or result may have been lost in the blip: restart every worker on a fresh
        core (a new session makes the worker drop its state) and recompute in-flight work."""
        for worker in list(self.pool.workers.values()):
            self._adopt(worker.hello, fresh=True)

    # ---- gateway side ------------------------------------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        try:
            sub = self._dec[SubmitRequest].decode(msg.data)
            reply = self._admit(sub)
        except msgspec.DecodeError as exc:
            reply = SubmitReply(accepted=False, status=400, message=f"malformed request: {exc}")
        if not reply.accepted:
            self.metrics.rejected.labels(str(reply.status)).inc()
        await msg.respond(encode(reply))

    def _admit(self, sub: SubmitRequest) -> SubmitReply:
        if self.draining:
            return SubmitReply(accepted=False, status=503, message="scheduler is shutting down")
        if not self.pool.workers:
            return SubmitReply(accepted=False, status=503, message="no worker is ready")
        if sum(len(w.core.waiting) for w in self.pool.workers.values()) >= self.config.max_waiting:
            return SubmitReply(accepted=False, status=429, message="the request queue is full")
        if sub.req_id in self.placement:
            return SubmitReply(accepted=False, status=400, message="duplicate request id")
        vocab_size = min(w.hello.vocab_size for w in self.pool.workers.values())
        try:
            validate_sampling_params(sub.sampling_params, vocab_size)
        except SamplingParamsError as exc:
            return SubmitReply(accepted=False, status=400, message=f"{exc.param}: {exc.message}")
        max_len = self.pool.max_model_len
        num_tokens = len(sub.prompt_token_ids) + len(sub.output_token_ids)
        if num_tokens >= max_len or not sub.prompt_token_ids:
            message = (
                "the prompt is empty"
                if not sub.prompt_token_ids
                else context_length_error(max_len, num_tokens, sub.sampling_params.max_tokens)
            )
            return SubmitReply(accepted=False, status=400, message=message)
        request = Request(
            sub.req_id,
            list(sub.prompt_token_ids),
            sub.sampling_params,
            output_token_ids=sub.output_token_ids,
            priority=sub.priority,
        )
        self.gateway_of[sub.req_id] = sub.gateway_id
        max_tokens = sub.sampling_params.max_tokens
        if max_tokens is not None and len(sub.output_token_ids) >= max_tokens:
            # a continuation whose finishing delta was lost: it is already complete
            done = RequestOutput(sub.req_id, [], FinishReason.LENGTH)
            asyncio.get_running_loop().create_task(self._publish_outputs([done]))
            return SubmitReply(accepted=True)
        self._place(request)
        return SubmitReply(accepted=True)

    def _place(self, request: Request) -> None:
        try:
            worker = self.pool.place(request)
        except LookupError:
            self.unplaced.append(request)
            return
        worker.core.add_request(request)
        self.placement[request.req_id] = worker
        self.wakeups[worker.worker_id].set()

    async def _on_abort(self, payload: bytes, _msg: Msg) -> None:
        try:
            req_ids = self._dec[AbortRequests].decode(payload).req_ids
        except msgspec.DecodeError:
            log.warning("ignoring malformed abort message")
            return
        for req_id in req_ids:
            self._abort(req_id)

    def _abort(self, req_id: str) -> None:
        worker = self.placement.pop(req_id, None)
        self.gateway_of.pop(req_id, None)
        self.unplaced = [r for r in self.unplaced if r.req_id != req_id]
        if worker is not None:
            worker.core.abort([req_id])
            self.wakeups[worker.worker_id].set()  # tell the worker to free its state

    # ---- worker side -------------------------------------------------------------------

    async def _on_hello(self, payload: bytes, _msg: Msg) -> None:
        try:
            hello = self._dec[WorkerHello].decode(payload)
        except msgspec.DecodeError:
            log.warning("ignoring malformed worker hello")
            return
        self._adopt(hello)

    def _adopt(self, hello: WorkerHello, fresh: bool = False) -> None:
        """Start driving a new worker, or a fresh core for one whose state is gone."""
        handle, replaced = self.pool.register(hello, fresh)
        survivors = []
        if replaced is not None:
            log.warning("worker %s state reset: its KV cache is gone", hello.worker_id)
            survivors = self._stop_worker(replaced)
        if hello.worker_id not in self.loops:
            log.info(
                "worker %s ready: %s, %d blocks", hello.worker_id, hello.model, hello.num_blocks
            )
            self.wakeups.setdefault(hello.worker_id, asyncio.Event())
            self.loops[hello.worker_id] = asyncio.create_task(self._worker_loop(handle))
            self._migrate(survivors)
            self._place_unplaced()

    async def _on_result(self, payload: bytes, _msg: Msg) -> None:
        try:
            output = self._dec[ModelRunnerOutput].decode(payload)
        except msgspec.DecodeError:
            log.warning("ignoring malformed sampler output")
            return
        future = self.pending.pop((output.worker_id, output.step_id), None)
        if future is not None and not future.done():
            future.set_result(output)

    async def _worker_loop(self, worker: WorkerHandle) -> None:
        """plan -> result -> update -> next plan, for as long as the worker lives."""
        wid, core = worker.worker_id, worker.core
        wakeup = self.wakeups[wid]
        plan_subject = self.subjects.plan(wid)
        while True:
            if not core.has_unfinished() and not core.finished_req_ids:
                wakeup.clear()
                await wakeup.wait()
            t0 = time.perf_counter()
            plan = core.schedule()
            plan.worker_session = f"{self.epoch}:{worker.session}"
            if (
                not plan.num_scheduled_tokens
                and not plan.finished_req_ids
                and not plan.preempted_req_ids
            ):
                wakeup.clear()
                await wakeup.wait()
                continue
            now = time.monotonic()
            for new in plan.new_reqs:  # first admission (or arrival on this worker)
                self.metrics.queue_time.observe(now - core.requests[new.req_id].arrival_time)
            future = asyncio.get_running_loop().create_future()
            self.pending[(wid, plan.step_id)] = future
            data = encode(plan)
            self.metrics.plan_bytes.observe(len(data))
            t_sched = time.perf_counter() - t0
            await bus.publish(self.nc, plan_subject, data)
            t1 = time.perf_counter()
            try:
                output = await asyncio.wait_for(future, self.config.step_timeout_s)
            except TimeoutError:
                log.error("worker %s: no result for step %d; resetting it", wid, plan.step_id)
                self.loops.pop(wid, None)  # this task ends here; _adopt starts a new one
                self._adopt(worker.hello, fresh=True)
                return
            self.metrics.step_seconds.labels(wid).observe(time.perf_counter() - t1)
            self.metrics.execute_seconds.labels(wid).observe(output.execute_s)
            t2 = time.perf_counter()
            outputs = core.update(output)
            await self._publish_outputs(outputs)
            self.metrics.schedule_seconds.observe(t_sched + time.perf_counter() - t2)
            self._refresh_gauges()

    async def _publish_outputs(self, outputs: list[RequestOutput]) -> None:
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
                )
            )
            if out.finish_reason is not None:
                self.placement.pop(out.req_id, None)
                self.gateway_of.pop(out.req_id, None)
        for gateway, deltas in by_gateway.items():
            batch = OutputBatch(deltas=deltas, scheduler_epoch=self.epoch)
            await bus.publish(self.nc, self.subjects.output(gateway), encode(batch))

    # ---- liveness and migration --------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            for worker in self.pool.expired(self.config.worker_timeout_s):
                log.warning(
                    "worker %s missed its heartbeats: re-placing its requests", worker.worker_id
                )
                self.pool.remove(worker.worker_id)
                self.wakeups.pop(worker.worker_id, None)
                self._migrate(self._stop_worker(worker))
            self._refresh_gauges()
            await self._publish_heartbeat()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def _stop_worker(self, worker: WorkerHandle) -> list[Request]:
        """Stop driving a worker whose state is gone; returns its unfinished requests."""
        loop = self.loops.pop(worker.worker_id, None)
        if loop is not None:
            loop.cancel()
        for key in [k for k in self.pending if k[0] == worker.worker_id]:
            self.pending.pop(key).cancel()
        survivors = [*worker.core.running, *worker.core.waiting]
        for request in survivors:
            self.placement.pop(request.req_id, None)
        return survivors

    def _migrate(self, survivors: list[Request]) -> None:
        """Re-place requests with the tokens generated so far; only their KV cache is lost."""
        for request in survivors:
            moved = Request(
                request.req_id,
                request.prompt_token_ids,
                request.sampling_params,
                output_token_ids=request.output_token_ids,
                priority=request.priority,
            )
            moved.arrival_time = request.arrival_time
            self.metrics.migrations.inc()
            self._place(moved)

    def _place_unplaced(self) -> None:
        pending, self.unplaced = self.unplaced, []
        for request in pending:
            self._place(request)

    async def _publish_heartbeat(self) -> None:
        cores = [w.core for w in self.pool.workers.values()]
        beat = SchedulerHeartbeat(
            epoch=self.epoch,
            num_ready_workers=0 if self.draining else len(cores),
            model=next((w.hello.model for w in self.pool.workers.values()), ""),
            max_model_len=self.pool.max_model_len,
            num_running=sum(len(c.running) for c in cores),
            num_waiting=sum(len(c.waiting) for c in cores) + len(self.unplaced),
            kv_cache_usage=max((c.kv.pool.usage() for c in cores), default=0.0),
        )
        if self.nc.is_connected:
            await self.nc.publish(self.subjects.scheduler_heartbeat, encode(beat))

    def _refresh_gauges(self) -> None:
        m, cores = self.metrics, [w.core for w in self.pool.workers.values()]
        m.running.set(sum(len(c.running) for c in cores))
        m.waiting.set(sum(len(c.waiting) for c in cores) + len(self.unplaced))
        m.kv_usage.set(max((c.kv.pool.usage() for c in cores), default=0.0))
        m.workers_ready.set(len(cores))
        totals = {
            m.prefix_queries: sum(c.kv.prefix_queries for c in cores),
            m.prefix_hits: sum(c.kv.prefix_hits for c in cores),
            m.preemptions: sum(c.num_preemptions for c in cores),
        }
        for counter, total in totals.items():  # counters follow totals kept by the cores
            counter.inc(max(total - self._counted.get(counter, 0), 0))
            self._counted[counter] = max(total, self._counted.get(counter, 0))

    async def _on_stats(self, msg: Msg) -> None:
        await msg.respond(json.dumps(self.stats()).encode())

    def stats(self) -> dict:
        return {
            "epoch": self.epoch,
            "num_requests": len(self.placement) + len(self.unplaced),
            "workers": {
                wid: {
                    "num_blocks": w.core.kv.pool.num_blocks,
                    "num_free_blocks": w.core.kv.pool.num_free_blocks,
                    "num_running": len(w.core.running),
                    "num_waiting": len(w.core.waiting),
                    "num_preemptions": w.core.num_preemptions,
                    "statuses": {
                        r.req_id: r.status.value
                        for r in w.core.requests.values()
                        if r.status != RequestStatus.FINISHED
                    },
                }
                for wid, w in self.pool.workers.items()
            },
        }
