"""The scheduler process's /health, /ready and /metrics (`shared.http_probes`), served from
start-up on, so that a standby replica (leader election) answers probes before it leads.

/health: its event loop responds. /ready: the scheduler is connected to NATS and serving, or
the replica stands by for the Lease. /metrics: the serving scheduler's (none while standing by).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from shared.http_probes import ProbeServer, loop_responds

log = logging.getLogger("skiff.scheduler")
LOOP_TIMEOUT_S = 3.0  # /health fails when the event loop takes longer to run a callback


class HttpEndpoint:
    """Probes and metrics of whichever scheduler this process runs (`serve`)."""

    def __init__(self, *, standby: bool) -> None:
        self.standby = standby
        self.service: SchedulerService | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)  # collect() below: the current scheduler's metrics
        self._live = loop_responds(asyncio.get_running_loop(), LOOP_TIMEOUT_S)
        self._server: ProbeServer | None = None

    @classmethod
    def start(cls, config: SchedulerServiceConfig) -> HttpEndpoint:
        """Serve on `--metrics-host:--metrics-port` (not at all when the port is 0); a port
        that cannot be bound is logged, and the scheduler schedules all the same."""
        endpoint = cls(standby=config.leader_election)
        if config.metrics_port:
            server = ProbeServer(endpoint.registry, live=endpoint.live, ready=endpoint.ready)
            try:
                server.start(config.metrics_host, config.metrics_port)
                endpoint._server = server
            except OSError as exc:  # e.g. another scheduler has it
                log.error(
                    "no /metrics, /health, /ready: cannot serve on %s:%d: %s",
                    config.metrics_host,
                    config.metrics_port,
                    exc,
                )
        return endpoint

    def serve(self, service: SchedulerService) -> None:
        """From now on, report `service`."""
        self.service = service

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def live(self) -> str | None:
        return self._live()

    def ready(self) -> str | None:
        if self.service is None:
            return None if self.standby else "starting"
        return self.service.ready()

    def collect(self) -> Iterable[Metric]:
        service = self.service  # read once: the loop may set it meanwhile
        return () if service is None else service.metrics.registry.collect()
