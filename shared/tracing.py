"""OpenTelemetry tracing, off unless an OTLP traces endpoint is set (`--otlp-traces-endpoint`,
as in vLLM). Off, nothing of OpenTelemetry is imported and `tracer` is None: every hook is one
`if tracing.tracer is not None` away from free. On, spans go to the endpoint over OTLP/HTTP
(protobuf) in batches; the SDK's standard `OTEL_*` variables apply (headers, batch delays,
sampler, resource attributes, `OTEL_SERVICE_NAME` over our `skiff-<service>`).

A request's W3C trace context crosses the wire as a `traceparent` string
(`00-<trace id>-<span id>-<flags>`): the gateway puts it on `SubmitRequest`, the scheduler on
`NewRequestData`; `Tracer.start` takes it as the remote parent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float


class Tracer:
    """The service's OpenTelemetry tracer with W3C `traceparent` strings for the wire."""

    def __init__(self, endpoint: str, service: str) -> None:
        try:
            from opentelemetry import context, propagate, trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:  # a service cannot start with tracing asked and impossible
            raise SystemExit(
                f"--otlp-traces-endpoint needs pip install 'skiff[otel]': {exc}"
            ) from exc
        self._trace, self._context, self._propagate = trace, context, propagate
        name = os.environ.get("OTEL_SERVICE_NAME") or f"skiff-{service}"
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("skiff")
        self.server = trace.SpanKind.SERVER
        self.internal = trace.SpanKind.INTERNAL

    def start(
        self,
        name: str,
        *,
        parent: str | None = None,
        links: Iterable[Any] = (),
        attributes: Mapping[str, AttributeValue] | None = None,
        kind: Any = None,
        start_time: int | None = None,
    ) -> Any:
        """A started span: child of `parent` (a traceparent) if given, else of the current
        span (contextvars), else a new trace's root. End it with `span.end()`."""
        ctx = self.extract(parent) if parent else None
        return self._tracer.start_span(
            name,
            context=ctx,
            kind=kind or self.internal,
            links=[self._trace.Link(c) for c in links],
            attributes=attributes,
            start_time=start_time,
        )

    def span(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Any:
        """Context manager: a child span of the current one, current while it runs."""
        return self._tracer.start_as_current_span(name, attributes=attributes)

    def use(self, span: Any) -> Any:
        """Context manager making `span` the current one (it does not end it)."""
        return self._trace.use_span(span, end_on_exit=False)

    def extract(self, traceparent: str) -> Any:
        """The context of a `traceparent` string (an invalid one gives an empty context)."""
        return self._propagate.extract({"traceparent": traceparent})

    def traceparent(self, span: Any = None) -> str | None:
        """`span`'s (default: the current span's) context as a traceparent, None if invalid."""
        carrier: dict[str, str] = {}
        ctx = self._trace.set_span_in_context(span) if span is not None else None
        self._propagate.inject(carrier, context=ctx)
        return carrier.get("traceparent")

    def shutdown(self) -> None:
        """Export what is queued (also done at interpreter exit)."""
        self.provider.shutdown()


tracer: Tracer | None = None  # set by setup_tracing when an endpoint is configured


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: `endpoint` as is, or with `/v1/traces` when it has no path
    (`http://collector:4318`)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"OTLP traces endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def setup_tracing(endpoint: str, service: str) -> None:
    """Turn tracing on for this process when `endpoint` is set; a no-op otherwise."""
    global tracer
    if not endpoint:
        return
    tracer = Tracer(endpoint, service)
    log.info("tracing: OTLP spans to %s", traces_url(endpoint))
