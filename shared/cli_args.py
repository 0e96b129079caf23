"""Flags that fall back to SKIFF_* environment variables (how containers configure services)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal


def env_default(name: str, default, cast=str):
    value = os.environ.get(f"SKIFF_{name.upper()}")
    return default if value is None else cast(value)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=env_default("nats_url", "nats://127.0.0.1:4222"))
    parser.add_argument("--subject-prefix", default=env_default("subject_prefix", "skiff"))
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the service name and, when given, the request id
    (`log.info("...", extra={"request_id": rid})`)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, service: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT (then the service drains and stops)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
