"""A service's small HTTP endpoint for Kubernetes and Prometheus: `GET /health` (liveness),
`GET /ready` (readiness) and `GET /metrics`.

It is prometheus_client's own server extended with the two probes: a threaded WSGI server
(stdlib `wsgiref`) outside the service's event loop, so it answers while the loop is busy and
can tell when the loop is stuck (`loop_responds`). A probe is a `Check`: a function returning
None when all is well, else the reason, which becomes a 503's body. A passing /health adds a
line when the NATS auth callout is lost (`shared.callout_watch`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from shared import callout_watch

log = logging.getLogger("skiff.http")

Check = Callable[[], str | None]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def loop_responds(loop: asyncio.AbstractEventLoop, timeout_s: float) -> Check:
    """A check that the event loop `loop` runs a callback within `timeout_s` (call it from
    another thread)."""

    def check() -> str | None:
        done = threading.Event()
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:  # closed
            return "the event loop is closed"
        if not done.wait(timeout_s):
            return f"the event loop did not respond within {timeout_s:g} s"
        return None

    return check


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a probe stuck on a dead loop must not hold the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: no access log."""


class ProbeServer:
    """Serves `/health` (`live`), `/ready` (`ready`) and `/metrics` (`registry`) from a
    daemon thread once `start`ed."""

    def __init__(self, registry: CollectorRegistry, *, live: Check, ready: Check) -> None:
        self._routes = {"/health": live, "/ready": ready}
        self._metrics = make_wsgi_app(registry)
        self._httpd: WSGIServer | None = None

    def app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI application."""
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            # The text format, whatever the Accept header: prometheus_client's OpenMetrics
            # output escapes the colons of vLLM's names (vllm:x -> vllm_x) for a Prometheus
            # that does not ask for UTF-8 names, as Prometheus 2 does not.
            environ = {**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        check = self._routes.get(path)
        if check is None:
            return _reply(start_response, "404 Not Found", "not found: try /health, /ready\n")
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", "GET only\n")
        try:
            reason = check()
        except Exception as exc:  # a broken check fails the probe, it does not kill the server
            log.exception("probe %s failed", path)
            reason = f"probe error: {exc!r}"
        if reason is None:
            note = callout_watch.health_note() if path == "/health" else None
            return _reply(start_response, "200 OK", "ok\n" + (f"{note}\n" if note else ""))
        return _reply(start_response, "503 Service Unavailable", reason + "\n")

    def start(self, host: str, port: int) -> None:
        """Listen on `host:port` (raises OSError when it cannot) and serve from a thread."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("Server", (_Server,), {"address_family": family})
        self._httpd = make_server(host, port, self.app, server_class, _QuietHandler)
        threading.Thread(target=self._httpd.serve_forever, name="http-probes", daemon=True).start()

    @property
    def port(self) -> int:
        """The port it listens on (0 before `start`)."""
        return 0 if self._httpd is None else int(self._httpd.server_address[1])

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def _reply(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    start_response(status, headers)
    return [data]
