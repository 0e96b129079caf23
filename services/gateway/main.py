"""Run the gateway: `python -m services.gateway.main --nats-url nats://... --port 8000`.

Every flag also reads an environment variable (`--nats-url` ← `SKIFF_NATS_URL`, and so on).
On SIGTERM/SIGINT the gateway drains: /health turns 503 and new generation requests get 503,
uvicorn stops accepting connections, and in-flight streams get up to `--drain-timeout` seconds
to finish before they are cancelled (which aborts their engine requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn
from prometheus_client import disable_created_metrics

from services.gateway.app import DEFAULT_MAX_BODY_BYTES, create_app
from services.gateway.context import GatewayContext
from services.gateway.engine_client import NatsEngineClient
from services.gateway.logs import configure_logging
from shared.default_model import DEFAULT_MODEL_NAME, default_model_dir
from shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "0.0.0.0"
    port: int = 8000
    model_dir: str | None = None  # None: the embedded default model
    served_model_name: str | None = None  # None: the model directory's name
    api_key: str | None = None
    subject_prefix: str = "skiff"
    gateway_id: str | None = None  # None: random, unique per process
    max_model_len: int | None = None  # None: from the scheduler's heartbeat
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0
    model_wait_timeout: float = 0.0  # wait this long for the tokenizer files to appear
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.drain_timeout < 0 or self.model_wait_timeout < 0:
            raise ValueError("timeouts must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.gateway_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", self.gateway_id):
            raise ValueError(f"gateway id must be letters, digits, '_' or '-': {self.gateway_id!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", self.subject_prefix):
            raise ValueError(f"invalid NATS subject prefix: {self.subject_prefix!r}")

    @property
    def resolved_model_dir(self) -> Path:
        return Path(self.model_dir) if self.model_dir else default_model_dir()

    @property
    def resolved_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.resolved_model_dir.name if self.model_dir else DEFAULT_MODEL_NAME


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """Flags, with `SKIFF_*` environment variables as defaults (argparse parses those too)."""
    env = os.environ.get
    d = GatewayConfig()
    p = argparse.ArgumentParser(
        prog="python -m services.gateway.main",
        description="skiff gateway (OpenAI-compatible HTTP API)",
    )
    p.add_argument("--nats-url", default=env("SKIFF_NATS_URL", d.nats_url))
    p.add_argument("--host", default=env("SKIFF_HOST", d.host))
    p.add_argument("--port", type=int, default=env("SKIFF_PORT", str(d.port)))
    p.add_argument(
        "--model-dir",
        default=env("SKIFF_MODEL_DIR"),
        help="model directory with tokenizer.json (default: the embedded model)",
    )
    p.add_argument("--served-model-name", default=env("SKIFF_SERVED_MODEL_NAME"))
    p.add_argument("--api-key", default=env("SKIFF_API_KEY"))
    p.add_argument("--subject-prefix", default=env("SKIFF_SUBJECT_PREFIX", d.subject_prefix))
    p.add_argument("--gateway-id", default=env("SKIFF_GATEWAY_ID"))
    p.add_argument(
        "--max-model-len",
        type=int,
        default=env("SKIFF_MAX_MODEL_LEN"),
        help="default: announced by the scheduler",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=env("SKIFF_MAX_BODY_BYTES", str(d.max_body_bytes))
    )
    p.add_argument(
        "--drain-timeout", type=float, default=env("SKIFF_DRAIN_TIMEOUT", str(d.drain_timeout))
    )
    p.add_argument(
        "--model-wait-timeout",
        type=float,
        default=env("SKIFF_MODEL_WAIT_TIMEOUT", str(d.model_wait_timeout)),
    )
    p.add_argument("--log-level", default=env("SKIFF_LOG_LEVEL", d.log_level))
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            nats_url=a.nats_url,
            host=a.host,
            port=a.port,
            model_dir=a.model_dir,
            served_model_name=a.served_model_name,
            api_key=a.api_key or None,
            subject_prefix=a.subject_prefix,
            gateway_id=a.gateway_id,
            max_model_len=a.max_model_len,
            max_body_bytes=a.max_body_bytes,
            drain_timeout=a.drain_timeout,
            model_wait_timeout=a.model_wait_timeout,
            log_level=a.log_level,
        )
    except ValueError as e:
        p.error(str(e))


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the app learns about the exit signal first (to fail health checks)."""

    def __init__(self, config: uvicorn.Config, ctx: GatewayContext) -> None:
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.ctx.draining:
            logger.info(
                "draining: finishing in-flight requests (up to %.0f s)",
                self.config.timeout_graceful_shutdown or 0,
            )
        self.ctx.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, without re-raising the signal afterwards: the NATS connection still
        has to be closed, and a drained gateway exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


async def _wait_for_tokenizer(model_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (model_dir / "tokenizer.json").exists():
        if time.monotonic() >= deadline:
            raise SystemExit(
                f"no tokenizer.json in {model_dir} (prepare the model first, "
                "or set --model-wait-timeout)"
            )
        await asyncio.sleep(1.0)


async def serve(config: GatewayConfig) -> None:
    """Connect to NATS (in the background) and serve HTTP until a signal drains the server."""
    model_dir = config.resolved_model_dir
    await _wait_for_tokenizer(model_dir, config.model_wait_timeout)
    tokenizer = Tokenizer(model_dir)
    engine = NatsEngineClient(
        config.nats_url, gateway_id=config.gateway_id, subject_prefix=config.subject_prefix
    )
    await engine.start()
    app = create_app(
        engine,
        tokenizer,
        config.resolved_model_name,
        config.max_model_len,
        config.api_key,
        max_body_bytes=config.max_body_bytes,
        model_root=str(model_dir),
    )
    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=config.drain_timeout,  # type: ignore[arg-type]
            server_header=False,
        ),
        app.state.gateway,
    )
    logger.info(
        "gateway %s serving %s on %s:%d",
        engine.gateway_id,
        config.resolved_model_name,
        config.host,
        config.port,
    )
    try:
        await server.serve()
    finally:
        await asyncio.sleep(0.05)  # let aborts of cancelled streams go out
        await engine.close()


def run_gateway(config: GatewayConfig) -> None:
    configure_logging(config.log_level)
    disable_created_metrics()
    asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> None:
    run_gateway(parse_args(argv))


if __name__ == "__main__":
    main()
