"""`skiff worker`: load a model on one device and serve plans, or (`--device sim`) run
`--count` simulated workers without a model (flags and SKIFF_* variables derived from its
configs). With `--http-port`, /health, /ready and /metrics; on SIGTERM each worker says
goodbye to its scheduler, which moves its requests at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import uvloop

from services.worker.config import (
    SIM_DEVICE,
    RunnerConfig,
    SimConfig,
    WorkerHttpConfig,
    WorkerServiceConfig,
)
from services.worker.health import StepWatch, WorkerProbes
from services.worker.metrics import WorkerMetrics
from services.worker.model_config import ModelConfig
from services.worker.service import Runner, WorkerService
from shared import bus, tracing
from shared.cli_args import ConfigParser, wait_for_signal
from shared.config import TelemetryConfig
from shared.default_model import DEFAULT_MODEL_NAME
from shared.http_probes import ProbeServer, loop_responds
from shared.logs import setup_logging

log = logging.getLogger("skiff.worker")
LOOP_TIMEOUT_S = 3.0  # /health fails when the event loop takes longer to run a callback


def build_parser() -> ConfigParser:
    p = ConfigParser(prog="skiff worker", description=__doc__)
    p.add_argument(
        "--model", default=p.env("model"), help="HF-format model directory (default: embedded)"
    )
    p.add_argument(
        "--count",
        type=int,
        default=p.env("count", 1, int),
        help=f"workers in this process, ids <worker-id>-0..N-1 (--device {SIM_DEVICE} only)",
    )
    p.add_argument(
        "--roles",
        default=p.env("roles", ""),
        help="with --count: each worker's role, comma-separated, in order (default: --role)",
    )
    p.add_config(WorkerServiceConfig)
    p.add_config(WorkerHttpConfig)
    p.add_config(RunnerConfig, build=False)
    p.add_config(SimConfig)
    p.add_config(TelemetryConfig)
    return p


async def serve(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, configs = parser.parse_configs(argv)
    config: WorkerServiceConfig = configs[WorkerServiceConfig]
    http: WorkerHttpConfig = configs[WorkerHttpConfig]
    simulated = args.device == SIM_DEVICE
    if args.count < 1 or (args.count > 1 and not simulated):
        parser.error(f"--count must be 1, or more with --device {SIM_DEVICE}")
    roles = args.roles.split(",") if args.roles else [config.role] * args.count
    if len(roles) != args.count:
        parser.error(f"--roles names {len(roles)} roles for --count {args.count} workers")
    telemetry: TelemetryConfig = configs[TelemetryConfig]
    setup_logging(config.log_level, "worker", telemetry.log_format)
    tracing.setup_tracing(telemetry.otlp_traces_endpoint, "worker")

    model = args.model
    if not config.served_model_name:
        name = DEFAULT_MODEL_NAME if model is None else model
        config = dataclasses.replace(config, served_model_name=name)
    metrics = WorkerMetrics(config.served_model_name)
    probes = WorkerProbes(loop_responds(asyncio.get_running_loop(), LOOP_TIMEOUT_S))
    server = start_http(http, metrics, probes)  # /health: 503 while the model loads
    try:
        if model is None:
            from services.worker.gguf_convert import ensure_default_model

            model = str(ensure_default_model())  # converts only on first use
        runner_config = parser.config(RunnerConfig, args, model_dir=model)
        ids = [config.worker_id]
        if args.count > 1:
            ids = [f"{config.worker_id}-{i}" for i in range(args.count)]
        started = time.perf_counter()
        runners = build(runner_config, configs[SimConfig], ids)
        metrics.load_seconds.set(time.perf_counter() - started)
        services = [
            WorkerService(
                dataclasses.replace(config, worker_id=worker_id, role=role),
                runner,
                metrics=metrics,
                watch=StepWatch(http.execute_model_timeout, http.execute_model_timeout_factor),
            )
            for worker_id, role, runner in zip(ids, roles, runners, strict=True)
        ]
        try:
            await run(config, services, share_connection=simulated)
            probes.services = services
            await wait_for_signal()
            for service in services:
                await service.leave()
            if simulated:
                await services[0].nc.drain()
        finally:
            for runner in runners:
                runner.close()  # the disk tier's file goes
    finally:
        if server is not None:
            server.stop()


def build(config: RunnerConfig, sim: SimConfig, worker_ids: list[str]) -> list[Runner]:
    """The model runner of `worker_ids[0]` (loads the weights), or a simulated one per worker
    id; either way the model's config.json is read once."""
    if config.device == SIM_DEVICE:
        from services.worker.sim_runner import SimRunner

        model_config = ModelConfig.from_dir(config.model_dir)
        return [SimRunner(config, sim, model_config) for _ in worker_ids]
    from services.worker.model_runner import build_runner

    return [build_runner(config, worker_ids[0])]


async def run(
    config: WorkerServiceConfig, services: list[WorkerService], *, share_connection: bool
) -> None:
    """Start the services, with one NATS connection for all when `share_connection`."""
    if not share_connection:
        for service in services:
            await service.start()
        return
    # One NATS connection for all: 64 workers driven in closed loop at 50 ms steps took 2.3 ms
    # from plan to result beyond their execute_s instead of 4.2 ms with one connection each (and
    # 2230 instead of 1500 steps/s at 20 ms), as one reader and one flusher batch every
    # worker's messages where 64 of each contend for the loop and make 64x the syscalls.
    options = bus.ConnectOptions.from_config(config)
    nc = await bus.connect(config.nats_url, f"skiff-{config.worker_id}", options=options)
    for service in services:
        await service.start(nc)


def start_http(
    http: WorkerHttpConfig, metrics: WorkerMetrics, probes: WorkerProbes
) -> ProbeServer | None:
    """/health, /ready and /metrics when `http.http_port` is set; a port that cannot be
    bound is logged (the probes then fail, and Kubernetes restarts the pod)."""
    if not http.http_port:
        return None
    server = ProbeServer(metrics.registry, live=probes.live, ready=probes.ready)
    try:
        server.start(http.http_host, http.http_port)
    except OSError as exc:
        log.error("no /health, /ready, /metrics on %s:%d: %s", http.http_host, http.http_port, exc)
        return None
    return server


def main(argv: list[str] | None = None) -> None:
    uvloop.run(serve(argv))


if __name__ == "__main__":
    main()
