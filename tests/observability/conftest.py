"""One stack for the observability tests: simulated workers, JSON logs to files, and traces
to an in-process OTLP collector, exported every 100 ms."""

from __future__ import annotations

import pytest

from tests.observability.otlp_collector import OtlpCollector


@pytest.fixture(scope="session")
def otlp_collector():
    collector = OtlpCollector()
    yield collector
    collector.close()


@pytest.fixture(scope="session")
def observed_stack(launch_stack, otlp_collector):
    with pytest.MonkeyPatch.context() as env:  # the services inherit it when they start
        env.setenv("SKIFF_LOG_FORMAT", "json")
        env.setenv("SKIFF_OTLP_TRACES_ENDPOINT", otlp_collector.url)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        stack = launch_stack("observed", device="sim", workers=2)
    yield stack
    stack.stop()
