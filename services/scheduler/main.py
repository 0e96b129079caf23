"""`skiff scheduler`: run the scheduler service."""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import start_http_server

from services.scheduler.service import SchedulerService
from shared.cli_args import add_common, env_default, setup_logging, wait_for_signal
from shared.config import SchedulerConfig, SchedulerServiceConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="skiff scheduler", description=__doc__)
    add_common(p)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=env_default("max_num_batched_tokens", 2048, int),
    )
    p.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", 256, int))
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len", 8192, int))
    p.add_argument("--max-waiting", type=int, default=env_default("max_waiting", 1024, int))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--worker-timeout", type=float, default=env_default("worker_timeout", 5.0, float)
    )
    p.add_argument("--served-model-name", default=env_default("served_model_name", ""))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("metrics_port", 0, int),
        help="serve Prometheus /metrics on this port (0: off)",
    )
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    service = SchedulerService(
        SchedulerServiceConfig(
            nats_url=args.nats_url,
            subject_prefix=args.subject_prefix,
            model_name=args.served_model_name,
            max_waiting=args.max_waiting,
            worker_timeout_s=args.worker_timeout,
        ),
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
    )
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=service.metrics.registry)
    await service.start()
    await wait_for_signal()
    await service.drain()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, "scheduler")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
