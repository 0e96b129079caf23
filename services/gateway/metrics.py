"""Prometheus metrics of the gateway: vLLM's names where the meaning is the same, `skiff_`
for ours. Each app has its own registry (several apps can live in one test process).

The gateway sees what a client sees, so it owns the client-facing latencies (TTFT, inter-token
latency, end-to-end), request outcomes and token counts; queue, KV-cache and step metrics belong
to the scheduler. Each choice of an n>1 request counts as one request, as in vLLM V1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.gateway.engine_client import EngineClient
from services.gateway.key_file import ANONYMOUS
from services.gateway.shards import ROUTINGS, Shards

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


# Outcomes of a tenant's requests: answered (ok: status < 400, else error) or refused by one of
# its limits or rights (the key file's names).
TENANT_OUTCOMES = (
    "ok",
    "error",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrency",
    "model_not_allowed",
    "not_admin",
)


class GatewayMetrics:
    """Every metric of one gateway app; the per-model ones (labelled `model_name`) through
    `model` and `add_engine`."""

    def __init__(self, tenants: Sequence[str] = (ANONYMOUS,)) -> None:
        self.registry = CollectorRegistry()
        self._add_request_metrics()
        self._add_gateway_metrics()
        self._add_tenant_metrics(tenants)
        self._engines: dict[str, EngineClient] = {}  # by model name
        self._add_engine_metrics()

    def _add_request_metrics(self) -> None:
        """vLLM's per-request latencies and token counts, labelled by model."""
        model, reg = ["model_name"], self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, model, buckets=buckets, registry=reg)

        def count(name: str, doc: str) -> Counter:
            return Counter(name, doc, model, registry=reg)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between token deltas.", _LATENCY_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.prompt_tokens = count("vllm:prompt_tokens", "Prefill tokens.")
        self.generation_tokens = count("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )

    def model(self, name: str) -> ModelMetrics:
        """The request metrics of the model `name` (its series exist from now on)."""
        return ModelMetrics(
            name,
            self.ttft.labels(name),
            self.itl.labels(name),
            self.e2e.labels(name),
            self.request_prompt_tokens.labels(name),
            self.request_generation_tokens.labels(name),
            self.prompt_tokens.labels(name),
            self.generation_tokens.labels(name),
            self.success,
        )

    def _add_gateway_metrics(self) -> None:
        """The gateway's own: HTTP requests, work in flight, submits and early ends."""
        reg = self.registry
        self.http_requests = Counter(
            "skiff_gateway_http_requests",
            "HTTP requests served.",
            ["method", "route", "status"],
            registry=reg,
        )
        self.in_flight = Gauge(
            "skiff_gateway_requests_in_flight", "Generation requests being served.", registry=reg
        )
        self.submit_seconds = Histogram(
            "skiff_gateway_submit_seconds",
            "Submit round trip to the scheduler over NATS.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.client_disconnects = Counter(
            "skiff_gateway_client_disconnects",
            "Requests aborted because the client left.",
            registry=reg,
        )
        self.stop_string_aborts = Counter(
            "skiff_gateway_stop_string_aborts", "Requests finished by a stop string.", registry=reg
        )

    def _add_tenant_metrics(self, tenants: Sequence[str]) -> None:
        """Usage per tenant (API key), labelled by the tenant's name from the key file (a
        bounded set, never the key); every series exists from the start, at zero."""
        reg = self.registry
        self.tenant_requests = Counter(
            "skiff_gateway_tenant_requests",
            "Requests of each tenant by outcome: ok, error, or the limit or right that refused it.",
            ["tenant", "outcome"],
            registry=reg,
        )
        self.tenant_tokens = Counter(
            "skiff_gateway_tenant_tokens",
            "Tokens of each tenant's requests: prompt (once per prompt) and generation.",
            ["tenant", "kind"],
            registry=reg,
        )
        self.tenant_in_flight = Gauge(
            "skiff_gateway_tenant_requests_in_flight",
            "Requests of each tenant being served (streams until their end).",
            ["tenant"],
            registry=reg,
        )
        for tenant in tenants:
            for outcome in TENANT_OUTCOMES:
                self.tenant_requests.labels(tenant, outcome)
            for kind in ("prompt", "generation"):
                self.tenant_tokens.labels(tenant, kind)
            self.tenant_in_flight.labels(tenant)

    def _add_engine_metrics(self) -> None:
        """Each model's engine client: readiness, NATS connection, request counters and shard
        routing, read at scrape time."""
        reg = self.registry
        self.engine_ready = Gauge(
            "skiff_gateway_engine_ready",
            "1 when a scheduler of the model with workers is up.",
            ["model_name"],
            registry=reg,
        )
        self.nats_connected = Gauge(
            "skiff_nats_connected", "1 while connected to NATS.", ["model_name"], registry=reg
        )
        reg.register(_EngineStatsCollector(self._engines))
        reg.register(_ShardRoutingCollector(self._engines))

    def add_engine(self, model_name: str, engine: EngineClient) -> None:
        """Export the engine client of the model `model_name`."""
        self._engines[model_name] = engine
        self.engine_ready.labels(model_name).set_function(lambda: float(engine.ready))
        if hasattr(engine, "connected"):
            connected = self.nats_connected.labels(model_name)
            connected.set_function(lambda: float(engine.connected))


@dataclass(frozen=True)
class ModelMetrics:
    """vLLM's request metrics of one model."""

    name: str
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    success: Counter  # labelled by model and finish reason

    def finished(self, reason: str) -> None:
        self.success.labels(self.name, reason).inc()


class ChoiceTimer:
    """Latency and token accounting of one engine request."""

    def __init__(self, metrics: ModelMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.last = arrival
        self.num_tokens = 0
        self.done = False

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        (self.metrics.ttft if self.num_tokens == 0 else self.metrics.itl).observe(now - self.last)
        self.last = now
        self.num_tokens += count
        self.metrics.generation_tokens.inc(count)

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        m.finished(reason)
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)


class _EngineStatsCollector(Collector):
    def __init__(self, engines: dict[str, EngineClient]) -> None:
        self.engines = engines  # by model name

    def collect(self) -> Iterator[Metric]:
        for name in ("submitted", "rejected", "aborted", "migrated", "failed"):
            family = CounterMetricFamily(
                f"skiff_gateway_engine_{name}", f"Engine requests {name}.", labels=["model_name"]
            )
            for model, engine in self.engines.items():
                if hasattr(engine, "stats"):
                    family.add_metric([model], getattr(engine.stats, name))
            yield family


class _ShardRoutingCollector(Collector):
    """Requests routed to each scheduler shard of each model by reason, the prompt tokens
    matched there, and the ready workers of each shard this gateway can route to (as its
    heartbeats tell)."""

    def __init__(self, engines: dict[str, EngineClient]) -> None:
        self.engines = engines  # by model name

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "skiff_gateway_shard_requests",
            "Requests routed to each scheduler shard, by reason (prefix: its workers hold the "
            "longest prefix of the prompt; load: the least loaded).",
            labels=["model_name", "shard", "reason"],
        )
        matched = CounterMetricFamily(
            "skiff_gateway_shard_prefix_matched_tokens",
            "Prompt tokens of the requests routed to each shard that its prefix summary held.",
            labels=["model_name", "shard"],
        )
        ready = GaugeMetricFamily(
            "skiff_gateway_shard_ready_workers",
            "Ready workers of each scheduler shard by its last heartbeat; 0 while the shard is "
            "unavailable to this gateway (silent, leaving or without workers).",
            labels=["model_name", "shard"],
        )
        for model, engine in self.engines.items():
            shards: Shards | None = getattr(engine, "shards", None)
            for index, shard in enumerate(shards or ()):
                for reason in ROUTINGS:
                    routed.add_metric([model, str(index), reason], shard.routed[reason])
                matched.add_metric([model, str(index)], shard.matched_tokens)
                available = shards is not None and shards.available(shard)
                ready.add_metric([model, str(index)], shard.num_ready_workers if available else 0)
        yield routed
        yield matched
        yield ready
