"""`skiff scheduler`: run the scheduler service (flags and SKIFF_* variables from its configs);
with `--metrics-port`, /metrics, /health and /ready (services/scheduler/http_endpoint.py)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os

import uvloop

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.http_endpoint import HttpEndpoint
from services.scheduler.service import SchedulerService
from shared import tracing
from shared.cli_args import ConfigParser, wait_for_signal
from shared.config import SchedulerConfig, TelemetryConfig
from shared.logs import setup_logging

log = logging.getLogger("skiff.scheduler")

EXIT_LEASE_LOST = 3


def build_parser() -> ConfigParser:
    parser = ConfigParser(prog="skiff scheduler", description=__doc__)
    parser.add_config(SchedulerServiceConfig)
    parser.add_config(SchedulerConfig)
    parser.add_config(TelemetryConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[SchedulerServiceConfig, SchedulerConfig]:
    _, configs = build_parser().parse_configs(argv)
    return configs[SchedulerServiceConfig], configs[SchedulerConfig]


def tune_gc() -> None:
    """Fewer collections on the step path, which allocates a few objects per request and step:
    what exists at startup is frozen out of the collector, and young-generation collections run
    every 20,000 allocations instead of 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


async def serve(config: SchedulerServiceConfig, scheduler_config: SchedulerConfig) -> None:
    endpoint = HttpEndpoint.start(config)
    try:
        if config.leader_election:
            await serve_elected(config, scheduler_config, endpoint)
            return
        service = await start_service(config, scheduler_config, endpoint)
        await wait_for_signal()
        await service.hand_over()
    finally:
        endpoint.stop()


async def serve_elected(
    config: SchedulerServiceConfig, scheduler_config: SchedulerConfig, endpoint: HttpEndpoint
) -> None:
    """One replica of a shard's scheduler (`--leader-election`): it stands by, subscribed to
    nothing, until it holds the shard's Lease, then starts the scheduler (a new epoch, which
    gateways and workers follow) and exits as soon as it loses the Lease."""
    try:
        from services.scheduler import leader
    except ImportError as exc:
        raise SystemExit(f"--leader-election needs pip install 'skiff[k8s]': {exc}") from exc
    services: list[SchedulerService] = []

    async def lead() -> None:
        services.append(await start_service(config, scheduler_config, endpoint))

    try:
        elector = leader.elector_from_config(config, lead, exit_lease_lost)
    except leader.LeaderElectionError as exc:
        raise SystemExit(f"leader election: {exc}") from exc
    election = asyncio.create_task(elector.run())
    signalled = asyncio.create_task(wait_for_signal())
    await asyncio.wait({election, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if election.done():
        signalled.cancel()
        await election  # it ends only by an error: a lost Lease has exited already
    election.cancel()
    if services:
        await services[0].hand_over()


def exit_lease_lost(reason: str) -> None:
    """A leader that lost its Lease stops publishing at once: it exits, and Kubernetes (or
    `skiff serve`) starts it again, as a standby."""
    log.critical("exiting: %s", reason)
    logging.shutdown()
    os._exit(EXIT_LEASE_LOST)


async def start_service(
    config: SchedulerServiceConfig, scheduler_config: SchedulerConfig, endpoint: HttpEndpoint
) -> SchedulerService:
    """A scheduler of a new epoch, serving (and reported by `endpoint`)."""
    service = SchedulerService(config, scheduler_config)
    endpoint.serve(service)
    await service.start()
    return service


def main(argv: list[str] | None = None) -> None:
    _, configs = build_parser().parse_configs(argv)
    config, telemetry = configs[SchedulerServiceConfig], configs[TelemetryConfig]
    setup_logging(config.log_level, "scheduler", telemetry.log_format)
    tracing.setup_tracing(telemetry.otlp_traces_endpoint, "scheduler")
    scheduler_config = configs[SchedulerConfig]
    tune_gc()
    uvloop.run(serve(config, scheduler_config))


if __name__ == "__main__":
    main()
