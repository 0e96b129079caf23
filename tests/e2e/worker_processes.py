"""A stack whose workers run in processes of their own (`Stack.start_worker(i)`, also for
simulated workers), for tests that stop, hang or kill one worker while the other serves."""

from __future__ import annotations

import time
from pathlib import Path

from services.launcher import Stack, StackConfig
from tests.e2e.stats import scheduler_stats


def print_logs(logs: Path) -> None:
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def start_with_worker_processes(config: StackConfig, timeout_s: float = 120) -> Stack:
    """Start nats, the scheduler, `config.workers` worker processes and the gateway, and
    wait until the scheduler drives every worker; prints the logs and stops all on failure."""
    assert config.log_dir, "the logs are printed on failure"
    stack = Stack(config)
    try:
        stack.start_nats()
        stack.start_scheduler()
        for i in range(config.workers):
            stack.start_worker(i)
        stack.start_gateway()
        stack.wait_ready(timeout_s)
        deadline = time.monotonic() + 30
        while len(scheduler_stats(stack)["workers"]) < config.workers:
            assert time.monotonic() < deadline, "not every worker registered"
            time.sleep(0.2)
    except Exception:
        print_logs(Path(config.log_dir))
        stack.stop()
        raise
    return stack
