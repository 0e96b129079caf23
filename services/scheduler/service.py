"""The scheduler service: wires the NATS subjects to admission, placement, the worker drivers,
liveness of workers and gateways, output routing and telemetry, and runs the periodic liveness
checks and heartbeat.

See docs/architecture.md for how the parts fit together.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
from nats.aio.client import Client

from services.scheduler.admission import Admission
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.gateways import GatewayLiveness
from services.scheduler.handoff import TRANSFERRED, Handoff
from services.scheduler.liveness import Liveness
from services.scheduler.lora_registry import LoRARegistry, LoRARegistryError, parse_lora_modules
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.output_router import OutputRouter
from services.scheduler.placement import Placement
from services.scheduler.probe import HealthProbe
from services.scheduler.request import FinishReason, Request
from services.scheduler.scheduler import RequestOutput
from services.scheduler.senders import from_sender
from services.scheduler.telemetry import Telemetry
from services.scheduler.tracing import RequestTraces
from services.scheduler.worker_driver import StepDeadline, WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared import bus, tracing
from shared.config import SchedulerConfig
from shared.epochs import new_epoch
from shared.subjects import ANY_WORKER, Subjects
from shared.tasks import BackgroundTasks
from shared.wire import (
    AbortRequests,
    GatewayHeartbeat,
    LoRAAdapterChange,
    LoRAAdapterReply,
    LoRACheck,
    LoRARequest,
    ModelRunnerOutput,
    SchedulerHeartbeat,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitReply,
    SubmitRequest,
    WorkerGoodbye,
    WorkerHello,
)

log = logging.getLogger("skiff.scheduler")

# A worker reads an adapter to check it (a rank-16 adapter of a small model: well under 1 s)
LORA_CHECK_TIMEOUT_S = 30.0


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig, scheduler_config: SchedulerConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.subject_prefix)
        self.epoch = new_epoch()  # sorts after every earlier scheduler's
        self.metrics = SchedulerMetrics(config.served_model_name)
        self.pool = WorkerPool(scheduler_config)
        self.placement = Placement(self.pool, wake=self._wake, on_landed=self._handoff_landed)
        self.loras = LoRARegistry(
            parse_lora_modules(config.lora_modules), config.lora_root, config.served_model_name
        )
        self.admission = Admission(self.pool, self.placement, config.max_waiting, self.loras)
        self.router = OutputRouter(self._publish, self.subjects)
        self.liveness = Liveness(
            self.pool,
            self.placement,
            self._start_driver,
            self._start_probe,
            self.metrics,
            max_request_failures=config.max_request_failures,
            fail_request=self._fail_request,
        )
        self.gateways = GatewayLiveness()
        self.num_orphans_aborted = 0
        self.telemetry = Telemetry(
            self.epoch, self.pool, self.placement, self.metrics, config.prefix_summary_max_bytes
        )
        self.telemetry.loras = self.loras
        self.traces = RequestTraces(tracing.tracer) if tracing.tracer else None
        self.deadline = StepDeadline(config.step_timeout, config.step_timeout_per_token)
        self.nc: Client  # set by start()
        self.serving = False  # from start() until hand_over() or stop()
        self._tasks = BackgroundTasks("scheduler")

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.nc = await bus.connect(
            self.config.nats_url,
            "skiff-scheduler",
            options=bus.ConnectOptions.from_config(self.config),
            on_reconnect=self._on_reconnect,
        )
        self.metrics.nats_connected.set_function(lambda: float(self.nc.is_connected))
        s, nc = self.subjects, self.nc
        await bus.serve(
            nc, s.submit, SubmitRequest, self._on_submit, on_malformed=self._on_malformed_submit
        )
        await bus.subscribe(nc, s.abort, AbortRequests, self._on_abort)
        await bus.serve(nc, s.lora_adapters, LoRAAdapterChange, self._on_lora_change)
        dropped = self.metrics.worker_messages_dropped
        on_hello = from_sender(self._on_hello, dropped)
        await bus.subscribe_with_subject(nc, s.worker_hello(ANY_WORKER), WorkerHello, on_hello)
        await bus.subscribe_with_subject(nc, s.worker_heartbeat(ANY_WORKER), WorkerHello, on_hello)
        await bus.subscribe_with_subject(
            nc, s.worker_goodbye(ANY_WORKER), WorkerGoodbye, from_sender(self._on_goodbye, dropped)
        )
        await bus.subscribe_with_subject(
            nc, s.result(ANY_WORKER), ModelRunnerOutput, from_sender(self._on_result, dropped)
        )
        await bus.subscribe(nc, s.gateway_heartbeat, GatewayHeartbeat, self._on_gateway_heartbeat)
        await bus.serve(nc, s.scheduler_stats, SchedulerStatsRequest, self._on_stats)
        self._tasks.spawn(self._monitor(), "monitor")
        self.serving = True
        log.info("scheduler up, epoch %s", self.epoch)

    def ready(self) -> str | None:
        """Why /ready fails (None: it passes): connected to NATS and serving."""
        if not self.serving:
            return "leaving" if self.admission.leaving else "starting"
        if not self.nc.is_connected:
            return "not connected to NATS"
        return None

    async def hand_over(self) -> None:
        """Leave at once, for the next scheduler to take over: refuse new work, stop driving
        workers and announce it with a last heartbeat (`leaving`). Gateways move the requests
        in flight to the next scheduler as after a crash, under its new epoch, and workers
        drop their state on its first plan."""
        self.admission.leaving = True
        log.info("leaving: handing %d requests over", self.placement.num_requests)
        await self.stop(self.telemetry.heartbeat(leaving=True))

    async def stop(self, last_heartbeat: SchedulerHeartbeat | None = None) -> None:
        self.serving = False
        self._tasks.cancel()
        self.liveness.stop()
        if last_heartbeat is not None and self.nc.is_connected:
            await bus.publish(self.nc, self.subjects.scheduler_heartbeat, last_heartbeat)
        await self.nc.drain()

    async def _on_reconnect(self) -> None:
        self.liveness.reset_all()
        self.gateways.reset()

    async def _monitor(self) -> None:
        while True:
            self.liveness.expire(self.config.worker_timeout)
            self._abort_orphans()
            self.telemetry.refresh_gauges()
            if self.nc.is_connected:
                heartbeat = self.telemetry.heartbeat()
                await bus.publish(self.nc, self.subjects.scheduler_heartbeat, heartbeat)
            await asyncio.sleep(self.config.heartbeat_interval)

    # ---- gateway side ------------------------------------------------------------------

    async def _on_submit(self, sub: SubmitRequest) -> SubmitReply:
        self.gateways.heard(sub.gateway_id)
        reply = self.admission.check(sub)
        if reply.accepted:
            self._accept(sub)
        else:
            self.metrics.rejected.labels(str(reply.status)).inc()
        return reply

    async def _on_lora_change(self, change: LoRAAdapterChange) -> LoRAAdapterReply:
        """Load or unload an adapter. Requests running with an unloaded one finish with it;
        new ones naming it are refused."""
        try:
            if not change.load:
                lora = self.loras.remove(change.lora_name)
                log.info("LoRA adapter %s unloaded", lora.lora_name)
                return LoRAAdapterReply(ok=True, lora_path=lora.lora_path)
            lora = self.loras.resolve(change.lora_name, change.lora_path)
        except LoRARegistryError as e:
            return LoRAAdapterReply(ok=False, status=e.status, message=e.message)
        checked = await self._check_lora(lora)
        if not checked.ok:
            return checked
        try:
            self.loras.add(lora)  # the name may have been taken while the worker checked
        except LoRARegistryError as e:
            return LoRAAdapterReply(ok=False, status=e.status, message=e.message)
        log.info("LoRA adapter %s loaded from %s", lora.lora_name, lora.lora_path)
        return LoRAAdapterReply(ok=True, lora_path=lora.lora_path)

    async def _check_lora(self, lora: LoRARequest) -> LoRAAdapterReply:
        """A healthy worker with LoRA reads the adapter as it would to run it."""
        worker = next(
            (w for w in self.pool.workers.values() if w.healthy and w.hello.max_loras), None
        )
        if worker is None:
            message = "no worker with LoRA adapters (--enable-lora) is ready to check it"
            return LoRAAdapterReply(ok=False, status=503, message=message)
        subject = self.subjects.lora_check(worker.worker_id)
        try:
            return await bus.request(
                self.nc, subject, LoRACheck(lora=lora), LoRAAdapterReply, LORA_CHECK_TIMEOUT_S
            )
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as e:
            message = f"worker {worker.worker_id} did not check the adapter: {e!r}"
            return LoRAAdapterReply(ok=False, status=503, message=message)

    def _on_malformed_submit(self, error: str) -> SubmitReply:
        self.metrics.rejected.labels("400").inc()
        return SubmitReply(accepted=False, status=400, message=f"malformed request: {error}")

    def _accept(self, sub: SubmitRequest) -> None:
        self.router.add(sub.req_id, sub.gateway_id)
        max_tokens = sub.sampling_params.max_tokens
        if max_tokens is not None and len(sub.output_token_ids) >= max_tokens:
            # a continuation whose finishing delta was lost: it is already complete
            done = RequestOutput(sub.req_id, [], FinishReason.LENGTH)
            self._tasks.spawn(self.router.publish([done]), f"finish {sub.req_id}")
            return
        request = Request(
            sub.req_id,
            list(sub.prompt_token_ids),
            sub.sampling_params,
            output_token_ids=sub.output_token_ids,
            priority=sub.priority,
            lora=None if sub.lora_name is None else self.loras.get(sub.lora_name),
        )
        started_ns = time.time_ns() if self.traces is not None else 0
        self.placement.place(request)
        worker = self.placement.worker_of.get(sub.req_id)
        worker_id = worker.worker_id if worker is not None else None
        log.info(
            "request added",
            extra={"request_id": sub.req_id, "worker_id": worker_id, "gateway_id": sub.gateway_id},
        )
        if self.traces is not None:
            self.traces.added(sub.req_id, sub.traceparent, worker_id, started_ns)

    def _finished(self, req_id: str, reason: str) -> None:
        """Log (and trace) the end of a request: finished, or aborted."""
        log.info("request finished: %s", reason, extra={"request_id": req_id})
        if self.traces is not None:
            self.traces.finished(req_id, reason)

    def _fail_request(self, request: Request, error: str) -> None:
        """End a request that stalled or took down the workers running it: its client gets
        `error`, no worker gets it again."""
        log.error("request failed: %s", error, extra={"request_id": request.req_id})
        self.metrics.requests_failed.inc()
        if self.traces is not None:
            self.traces.finished(request.req_id, FinishReason.ERROR.value)
        self._tasks.spawn(self.router.fail(request.req_id, error), f"fail {request.req_id}")

    async def _on_abort(self, msg: AbortRequests) -> None:
        for req_id in msg.req_ids:
            if req_id in self.router.gateway_of:
                self._finished(req_id, "abort")
            self.placement.abort(req_id)
            self.router.forget(req_id)

    async def _on_stats(self, _: SchedulerStatsRequest) -> SchedulerStats:
        return self.telemetry.stats(self.num_orphans_aborted)

    async def _on_gateway_heartbeat(self, beat: GatewayHeartbeat) -> None:
        self.gateways.on_heartbeat(beat)

    def _abort_orphans(self) -> None:
        """Abort the requests of the gateways gone silent: nobody reads their tokens."""
        for gateway_id in self.gateways.silent(self.config.gateway_timeout):
            orphans = self.router.requests_of(gateway_id)
            if not orphans:
                continue
            log.warning(
                "gateway %s silent for %.0f s: aborting its %d requests",
                gateway_id,
                self.config.gateway_timeout,
                len(orphans),
            )
            for req_id in orphans:
                self._finished(req_id, "abort")
                self.placement.abort(req_id)
                self.router.forget(req_id)
            self.num_orphans_aborted += len(orphans)
            self.metrics.orphans_aborted.inc(len(orphans))

    # ---- worker side -------------------------------------------------------------------

    async def _on_hello(self, hello: WorkerHello) -> None:
        self.liveness.adopt(hello)

    async def _on_goodbye(self, goodbye: WorkerGoodbye) -> None:
        self.liveness.leave(goodbye)

    async def _on_result(self, output: ModelRunnerOutput) -> None:
        self.liveness.on_result(output)

    def _start_driver(self, worker: WorkerHandle) -> WorkerDriver:
        driver = WorkerDriver(
            worker,
            publish=self._publish,
            plan_subject=self.subjects.plan(worker.worker_id),
            epoch=self.epoch,
            deadline=self.deadline,
            metrics=self.metrics,
            on_outputs=self._on_outputs,
            on_handoff=self.placement.hand_off,
            on_stall=self.liveness.on_stall,
            traces=self.traces,
        )
        driver.start()
        return driver

    def _start_probe(self, worker: WorkerHandle) -> HealthProbe:
        probe = HealthProbe(
            worker,
            publish=self._publish,
            plan_subject=self.subjects.plan(worker.worker_id),
            epoch=self.epoch,
            interval_s=self.config.step_timeout,
            on_healthy=self.liveness.on_healthy,
        )
        probe.start()
        return probe

    async def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:
                log.error("request failed: %s", out.error, extra={"request_id": out.req_id})
                self.metrics.requests_failed.inc()
            if out.finish_reason is not None:
                self.placement.finish(out.req_id)
                self._finished(out.req_id, out.finish_reason.value)
        await self.router.publish(outputs)  # gauges follow on the monitor's tick, not per step

    def _handoff_landed(self, handoff: Handoff, num_loaded_bytes: int) -> None:
        outcome = handoff.outcome(num_loaded_bytes)
        self.metrics.pd_handoffs.labels(outcome).inc()
        if outcome == TRANSFERRED:
            self.metrics.pd_transfer_bytes.inc(num_loaded_bytes)
            self.metrics.pd_transfer_seconds.observe(time.monotonic() - handoff.started_at)

    def _wake(self, worker_id: str) -> None:
        self.liveness.wake(worker_id)

    # ---- plumbing ----------------------------------------------------------------------

    async def _publish(self, subject: str, msg: msgspec.Struct) -> int:
        return await bus.publish(self.nc, subject, msg)
