"""A scheduler on a real nats-server drops, and counts, a worker message whose body names
another worker than its subject's (a forged hello, goodbye or result) and heeds the others."""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from shared import bus
from shared.config import SchedulerConfig
from shared.subjects import Subjects
from shared.wire import ModelRunnerOutput, WorkerGoodbye
from tests.scheduler.fakes import make_hello

S = Subjects()


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_message_naming_another_worker_than_its_subject_is_dropped(nats_url):
    config = SchedulerServiceConfig(nats_url=nats_url, served_model_name="m")

    async def run() -> None:
        service = SchedulerService(config, SchedulerConfig())
        await service.start()
        nc = await bus.connect(nats_url, "test-forger")

        def dropped() -> float | None:
            return service.metrics.registry.get_sample_value(
                "skiff_worker_messages_dropped_total", {"reason": "wrong_sender"}
            )

        async def send(subject: str, message: msgspec.Struct) -> None:
            await bus.publish(nc, subject, message)
            await nc.flush()

        try:
            assert dropped() == 0
            await send(S.worker_hello("w1"), make_hello("w0"))  # w1 poses as w0
            await until(lambda: dropped() == 1, "the forged hello to be dropped")
            await send(S.worker_heartbeat("w1"), make_hello("w0"))
            await until(lambda: dropped() == 2, "the forged heartbeat to be dropped")
            assert "w0" not in service.pool.workers
            await send(S.worker_hello("w0"), make_hello("w0"))
            await until(lambda: "w0" in service.pool.workers, "w0's own hello")
            goodbye = WorkerGoodbye(worker_id="w0", instance_id="i0")
            await send(S.worker_goodbye("w1"), goodbye)
            await until(lambda: dropped() == 3, "the forged goodbye to be dropped")
            await send(S.result("w1"), ModelRunnerOutput(step_id=0, worker_id="w0"))
            await until(lambda: dropped() == 4, "the forged result to be dropped")
            assert "w0" in service.pool.workers  # the forged goodbye did not remove it
            await send(S.worker_goodbye("w0"), goodbye)
            await until(lambda: "w0" not in service.pool.workers, "w0's own goodbye")
            assert dropped() == 4
        finally:
            await nc.close()
            await service.stop()

    asyncio.run(run())
