"""Run the gateway: `python -m services.gateway.main --nats-url nats://... --port 8000`
(`--scheduler-shards N` to spread requests over N scheduler shards; `--extra-models` for more
models, each with an engine client on its own schedulers' subjects).

Every flag also reads an environment variable (`--nats-url` ← `SKIFF_NATS_URL`, and so on).
On SIGTERM/SIGINT the gateway drains: /health turns 503 and new generation requests get 503,
uvicorn stops accepting connections, and in-flight streams get up to `--drain-timeout` seconds
to finish; those still running then end with an error event (and their engine requests are
aborted), logged as one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn
import uvloop
from prometheus_client import disable_created_metrics

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineError, NatsEngineClient, new_gateway_id
from services.gateway.header_timeout import with_header_timeout
from services.gateway.key_file import KeyFileError, tenants_of
from services.gateway.models import ServedModels
from shared import tracing
from shared.cli_args import ConfigParser
from shared.config import TelemetryConfig
from shared.logs import setup_logging
from shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_parser() -> ConfigParser:
    parser = ConfigParser(prog="skiff gateway", description="skiff gateway (OpenAI-compatible API)")
    parser.add_config(GatewayConfig)
    parser.add_config(TelemetryConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """Flags, with `SKIFF_*` environment variables as defaults."""
    config: GatewayConfig = build_parser().parse_configs(argv)[1][GatewayConfig]
    return config


_CUT_GRACE_S = 2.0  # after the drain timeout, for cut streams to send their error event


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the app learns about the exit signal first (to fail health checks), and
    streams still running at the drain timeout end with an error event instead of being
    cancelled mid-response."""

    def __init__(
        self, config: uvicorn.Config, models: ServedModels, engines: list[NatsEngineClient]
    ) -> None:
        super().__init__(config)
        self.models = models
        self.engines = engines
        self.drain_timeout = (config.timeout_graceful_shutdown or 0) - _CUT_GRACE_S

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut = asyncio.get_running_loop().call_later(self.drain_timeout, self._cut_streams)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut_streams(self) -> None:
        num_in_flight = sum(engine.num_in_flight for engine in self.engines)
        if num_in_flight:
            logger.warning(
                "drain timeout (%.0f s): ending %d unfinished requests with an error",
                self.drain_timeout,
                num_in_flight,
            )
        for engine in self.engines:
            engine.requests.close(EngineError(503, "the gateway is shutting down"))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.models.draining:
            logger.info(
                "draining: finishing in-flight requests (up to %.0f s)",
                self.drain_timeout,
            )
        self.models.draining = True
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
    try:  # before waiting for anything: a bad key file is the operator's to fix now
        tenants = tenants_of(config.api_key, config.api_keys_file)
    except KeyFileError as e:
        raise SystemExit(f"skiff gateway: {e}") from None
    if config.gateway_id is None:  # one identity on every model's subjects
        config = dataclasses.replace(config, gateway_id=new_gateway_id())
    routes = config.models
    for route in routes:
        await _wait_for_tokenizer(Path(route.model_dir), config.model_wait_timeout)
    tokenizers = [Tokenizer(Path(route.model_dir)) for route in routes]
    engines = [NatsEngineClient(config.for_model(route)) for route in routes]
    for engine in engines:
        await engine.start()
    served = list(zip(engines, tokenizers, strict=True))
    app = create_app(engines[0], tokenizers[0], config, tenants, extra=served[1:])
    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=config.drain_timeout + _CUT_GRACE_S,  # type: ignore[arg-type]
            server_header=False,
            http=with_header_timeout(config.header_timeout),
            limit_concurrency=config.limit_concurrency,
        ),
        app.state.models,
        engines,
    )
    logger.info(
        "gateway %s serving %s on %s:%d",
        engines[0].gateway_id,
        ", ".join(route.name for route in routes),
        config.host,
        config.port,
    )
    try:
        await server.serve()
    finally:
        await asyncio.sleep(0.05)  # let aborts of cancelled streams go out
        for engine in engines:
            await engine.close()


def run_gateway(config: GatewayConfig, telemetry: TelemetryConfig | None = None) -> None:
    telemetry = telemetry or TelemetryConfig()
    setup_logging(config.log_level, "gateway", telemetry.log_format)
    tracing.setup_tracing(telemetry.otlp_traces_endpoint, "gateway")
    disable_created_metrics()  # type: ignore[no-untyped-call]
    uvloop.run(serve(config))


def main(argv: list[str] | None = None) -> None:
    configs = build_parser().parse_configs(argv)[1]
    run_gateway(configs[GatewayConfig], configs[TelemetryConfig])


if __name__ == "__main__":
    main()
