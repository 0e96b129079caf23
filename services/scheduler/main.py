"""`skiff scheduler`: run the scheduler service (flags and SKIFF_* variables from its configs)."""

from __future__ import annotations

import asyncio
import gc
import logging

from prometheus_client import start_http_server

from services.scheduler.service import SchedulerService
from shared.cli_args import ConfigParser, setup_logging, wait_for_signal
from shared.config import SchedulerConfig, SchedulerServiceConfig

log = logging.getLogger("skiff.scheduler")


def build_parser() -> ConfigParser:
    parser = ConfigParser(prog="skiff scheduler", description=__doc__)
    parser.add_config(SchedulerServiceConfig)
    parser.add_config(SchedulerConfig)
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
    service = SchedulerService(config, scheduler_config)
    if config.metrics_port:
        try:
            start_http_server(
                config.metrics_port, config.metrics_host, registry=service.metrics.registry
            )
        except OSError as exc:  # e.g. another scheduler has it: schedule all the same
            log.error(
                "no /metrics: cannot serve on %s:%d: %s",
                config.metrics_host,
                config.metrics_port,
                exc,
            )
    await service.start()
    await wait_for_signal()
    await service.hand_over()


def main(argv: list[str] | None = None) -> None:
    config, scheduler_config = parse_args(argv)
    setup_logging(config.log_level, "scheduler")
    tune_gc()
    asyncio.run(serve(config, scheduler_config))


if __name__ == "__main__":
    main()
