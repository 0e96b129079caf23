"""The worker service: owns one device, announces itself, executes plans exactly, in order,
serves its KV blocks to other workers (the KV-transfer server) and says goodbye when it
leaves."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, runtime_checkable

from nats.aio.client import Client

from services.worker.config import RunnerConfig, WorkerHttpConfig, WorkerServiceConfig
from services.worker.health import StepWatch
from services.worker.input_batch import InputBatch
from services.worker.kv_tiers.stats import KVTierStats
from services.worker.kv_transfer import BlockSource, TransferServer
from services.worker.lora.errors import LoRAError
from services.worker.metrics import WorkerMetrics
from services.worker.step_timer import StepTimer
from services.worker.tracing import BatchTraces
from shared import bus, tracing
from shared.epochs import STALE_EPOCH_SILENCE_S, EpochFollower
from shared.subjects import Subjects, worker_prefix
from shared.tasks import BackgroundTasks
from shared.wire import (
    BatchPlan,
    LoRAAdapterReply,
    LoRACheck,
    LoRARequest,
    ModelRunnerOutput,
    SchedulerHeartbeat,
    WorkerGoodbye,
    WorkerHello,
)

log = logging.getLogger("skiff.worker")
T = TypeVar("T")
KV_MEASURE_INTERVAL_S = 1.0  # counting the blocks in use costs up to a millisecond
NO_SESSION = ("", "")  # (BatchPlan.scheduler_epoch, BatchPlan.worker_session) before any plan


class KVTiers(Protocol):
    """A runner's KV tiers: their sizes and counters, and what it serves to other workers
    (None: nothing, no KV-transfer server). `transfer_address`: the address to advertise
    without a KV-transfer server ("": none; simulated tiers "fetch" at a modelled bandwidth)."""

    transfer_address: str

    @property
    def stats(self) -> KVTierStats: ...

    def block_source(self) -> BlockSource | None: ...


class Runner(Protocol):
    """What the service uses of a runner (ModelRunner, SimRunner)."""

    config: RunnerConfig
    num_blocks: int
    max_model_len: int
    device: Any
    model_config: Any  # vocab_size, eos_token_ids
    timer: StepTimer  # the last step's phases
    batch: InputBatch  # the persistent batch (its block tables)

    @property
    def kv_tiers(self) -> KVTiers: ...

    @property
    def progress(self) -> int:
        """Units of work done since start (decoder layers, logits passes), read from the loop
        while a step runs on the runner's thread."""
        ...

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput: ...

    def check_lora(self, lora: LoRARequest) -> None:
        """Raise `LoRAError` unless this runner can run `lora` (read as a load would)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None:
        """Release what outlives the service (the KV disk tier's file)."""
        ...


@runtime_checkable
class AsyncRunner(Protocol):
    """A runner whose steps are coroutines on the event loop (SimRunner): cheap to compute,
    they wait out their device time without a thread of their own."""

    async def step(self, plan: BatchPlan) -> ModelRunnerOutput: ...


class WorkerService:
    """One worker. `metrics` may be shared by the workers of one process; `watch` tells
    whether a step is wedged (liveness)."""

    def __init__(
        self,
        config: WorkerServiceConfig,
        runner: Runner,
        *,
        metrics: WorkerMetrics | None = None,
        watch: StepWatch | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.metrics = metrics or WorkerMetrics(config.served_model_name)
        self.series = self.metrics.worker(config.worker_id, self._connected)
        self.series.watch_device(runner)
        self.series.set_kv_blocks(runner.batch, runner.num_blocks)
        self.series.watch_kv_tiers(runner.kv_tiers.stats, lambda: 0)
        self.series.watch_lora(runner)
        self._kv_measured_at = 0.0  # time.monotonic() of the last KV block count
        http = WorkerHttpConfig()
        self.watch = watch or StepWatch(
            http.execute_model_timeout, http.execute_model_timeout_factor
        )
        # Ready once a scheduler adopted this instance (its first plan: the scheduler sends an
        # empty one on adoption), until it leaves or a step fails.
        self.adopted = False
        self.leaving = False
        self.subjects = Subjects(
            worker_prefix(config.subject_prefix, config.worker_id, config.scheduler_shards)
        )
        self._instance_id = uuid.uuid4().hex
        self.session = NO_SESSION  # (scheduler epoch, worker session) of the last plan run
        self.step_id = -1  # the step being executed (-1: none), reported with progress
        # A step of it failed: its plans still queued build on lost state.
        self._failed_session = NO_SESSION
        self._epochs = EpochFollower(STALE_EPOCH_SILENCE_S)  # a stale scheduler's plans: ignored
        # A blocking runner gets one thread: plans run strictly in arrival order, heartbeats go
        # on meanwhile. An AsyncRunner runs on the loop (and its plans in order all the same).
        self.executor: ThreadPoolExecutor | None = None
        if not isinstance(runner, AsyncRunner):
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        self._plans: asyncio.Queue[BatchPlan] = asyncio.Queue()
        self._traces = BatchTraces(tracing.tracer, config.worker_id) if tracing.tracer else None
        self._tasks = BackgroundTasks(config.worker_id)
        self.kv_transfer: TransferServer | None = None  # started with the service

    @property
    def instance_id(self) -> str:
        """New on every process start and after a failed step (its KV state is gone); the
        KV-transfer server serves only fetches addressed to the current one."""
        return self._instance_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self._instance_id = value
        if self.kv_transfer is not None:
            self.kv_transfer.instance_id = value

    def hello(self) -> WorkerHello:
        r, mc = self.runner, self.runner.model_config
        kv = r.kv_tiers.stats
        return WorkerHello(
            worker_id=self.config.worker_id,
            instance_id=self.instance_id,
            model=self.config.served_model_name,
            block_size=r.config.block_size,
            num_blocks=r.num_blocks,
            max_model_len=r.max_model_len,
            max_num_seqs=r.config.max_num_seqs,
            device=str(r.device),
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            step_id=self.step_id,
            progress=r.progress,
            num_host_blocks=kv.num_host_blocks,
            num_disk_blocks=kv.num_disk_blocks,
            kv_block_bytes=kv.block_bytes,
            kv_transfer_address=self.kv_transfer.address
            if self.kv_transfer is not None
            else r.kv_tiers.transfer_address,
            role=self.config.role,
            max_loras=r.config.max_loras if r.config.enable_lora else 0,
            max_lora_rank=r.config.max_lora_rank if r.config.enable_lora else 0,
        )

    def start_kv_transfer(self) -> None:
        """The KV-transfer server over the runner's tiers, if it has any to serve; a port
        that cannot be bound is logged (other workers then recompute instead of fetching)."""
        source = self.runner.kv_tiers.block_source()
        if source is None:
            return
        c = self.config
        try:
            server = TransferServer(
                source,
                self.instance_id,
                host=c.kv_transfer_host,
                port=c.kv_transfer_port,
                advertise_host=c.kv_transfer_advertise_host or None,
            )
        except OSError as exc:
            log.error(
                "no KV-transfer server on %s:%d: %s", c.kv_transfer_host, c.kv_transfer_port, exc
            )
            return
        server.start()
        self.kv_transfer = server
        self.series.watch_kv_tiers(self.runner.kv_tiers.stats, lambda: server.bytes_served)
        log.info("KV-transfer server at %s", server.address)

    async def start(self, nc: Client | None = None) -> None:
        """Connect, or use `nc` (shared by simulated workers; then the caller drains it)."""
        self._owns_nc = nc is None
        if nc is None:
            options = bus.ConnectOptions.from_config(self.config)
            nc = await bus.connect(
                self.config.nats_url, f"skiff-{self.config.worker_id}", options=options
            )
        self.nc = nc
        self.start_kv_transfer()
        plan_subject = self.subjects.plan(self.config.worker_id)
        await bus.subscribe(self.nc, plan_subject, BatchPlan, self._plans.put)
        await bus.subscribe(
            self.nc, self.subjects.scheduler_heartbeat, SchedulerHeartbeat, self._on_scheduler_beat
        )
        lora_check = self.subjects.lora_check(self.config.worker_id)
        await bus.serve(self.nc, lora_check, LoRACheck, self._on_lora_check)
        await bus.publish(self.nc, self.subjects.worker_hello(self.config.worker_id), self.hello())
        self._tasks.spawn(self._heartbeat(), "heartbeat")
        self._tasks.spawn(self._execute_loop(), "execute")
        log.info("worker %s up: %d KV blocks", self.config.worker_id, self.runner.num_blocks)

    async def _on_lora_check(self, check: LoRACheck) -> LoRAAdapterReply:
        """Read the adapter off the loop and the runner's thread (steps go on meanwhile)."""
        try:
            await asyncio.to_thread(self.runner.check_lora, check.lora)
        except LoRAError as e:
            return LoRAAdapterReply(ok=False, status=400, message=str(e))
        return LoRAAdapterReply(ok=True, lora_path=check.lora.lora_path)

    async def _on_scheduler_beat(self, beat: SchedulerHeartbeat) -> None:
        self._epochs.heard(beat.epoch)

    def _connected(self) -> bool:
        nc: Client | None = getattr(self, "nc", None)
        return nc is not None and nc.is_connected

    def live(self) -> str | None:
        """Why /health fails (None: it passes): a wedged step."""
        return self.watch.check(self.runner.progress)

    def ready(self) -> str | None:
        """Why /ready fails (None: it passes)."""
        if self.leaving:
            return "leaving"
        if not self.nc.is_connected:
            return "not connected to NATS"
        if not self.adopted:
            return "waiting for a scheduler to adopt it"
        return None

    async def leave(self) -> None:
        """Leave (on SIGTERM): take no more plans, tell the scheduler, which moves this
        worker's requests at once instead of after its heartbeat timeout, and stop."""
        self.leaving = True
        self._tasks.cancel()
        if self.nc.is_connected:
            goodbye = WorkerGoodbye(worker_id=self.config.worker_id, instance_id=self.instance_id)
            await bus.publish(self.nc, self.subjects.worker_goodbye(self.config.worker_id), goodbye)
            await self.nc.flush()
        log.info("worker %s said goodbye", self.config.worker_id)
        await self.stop()

    async def stop(self) -> None:
        self._tasks.cancel()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
        if self._owns_nc:
            await self.nc.drain()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the runner's thread, or on the loop for an AsyncRunner."""
        if self.executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        if isinstance(self.runner, AsyncRunner):
            return await self.runner.step(plan)
        return await self._call(self.runner.execute, plan)

    async def _execute_loop(self) -> None:
        while True:
            waiting_since = time.perf_counter()
            plan = await self._plans.get()
            idle_s = time.perf_counter() - waiting_since
            session = (plan.scheduler_epoch, plan.worker_session)
            if session == self._failed_session:
                continue  # planned before our failure was known (async scheduling)
            if not self._epochs.follow(plan.scheduler_epoch):
                log.debug("dropping step %d of a stale scheduler epoch", plan.step_id)
                continue
            if session != self.session:
                if plan.scheduler_epoch != self.session[0] and self.session != NO_SESSION:
                    log.warning("new scheduler epoch: dropping all request state")
                    self.series.epoch_changes.inc()
                elif self.session != NO_SESSION:
                    log.warning("new scheduler session: dropping all request state")
                self.session = session
                await self._call(self.runner.reset)
                if self._traces is not None:
                    self._traces.reset()
            self.adopted = True
            for new in plan.new_reqs:
                log.info("request added to batch", extra={"request_id": new.req_id})
            if self._traces is not None:
                self._traces.step(plan)
            start = time.perf_counter()
            self.watch.begin()
            self.step_id = plan.step_id
            try:
                output = await self._execute(plan)
            except Exception:
                # Come back as a new instance: the scheduler re-places our requests elsewhere
                # (or here, from scratch) instead of waiting for a result that never comes.
                log.exception("step %d failed; dropping all request state", plan.step_id)
                self.step_id = -1
                self.watch.end(time.perf_counter() - start, count=False)
                self.adopted = False  # until the scheduler adopts the new instance
                await self._call(self.runner.reset)
                if self._traces is not None:
                    self._traces.reset()
                self._failed_session = session
                self.instance_id = uuid.uuid4().hex
                await bus.publish(
                    self.nc, self.subjects.worker_hello(self.config.worker_id), self.hello()
                )
                continue
            self.step_id = -1
            if self._traces is not None:
                self._traces.step_done()
            output.worker_id = self.config.worker_id
            output.execute_s = time.perf_counter() - start
            output.idle_s = idle_s
            num_reqs = len(plan.num_scheduled_tokens)
            self.watch.end(output.execute_s, count=num_reqs > 0)
            await bus.publish(self.nc, self.subjects.result(self.config.worker_id), output)
            if num_reqs:
                self._observe(output.execute_s, plan)

    def _observe(self, execute_s: float, plan: BatchPlan) -> None:
        """Metrics of a step with tokens; the KV blocks in use at most once a second."""
        series = self.series
        series.observe_step(
            execute_s, plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens)
        )
        series.observe_timer(self.runner.timer)
        now = time.monotonic()
        if now - self._kv_measured_at >= KV_MEASURE_INTERVAL_S:
            self._kv_measured_at = now
            series.set_kv_blocks(self.runner.batch, self.runner.num_blocks)

    async def _heartbeat(self) -> None:
        """The hello, every `heartbeat_interval`, from the loop: during a long step it carries
        the step's id and the runner's progress, so the scheduler tells it from a hung one."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            if self.nc.is_connected:
                await bus.publish(
                    self.nc, self.subjects.worker_heartbeat(self.config.worker_id), self.hello()
                )
