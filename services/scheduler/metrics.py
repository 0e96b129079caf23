"""Prometheus metrics of the scheduler, under vLLM's names where the meaning is the same."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.handoff import OUTCOMES
from services.scheduler.senders import WRONG_SENDER
from shared.wire import WORKER_ROLES

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RTT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, *STEP_BUCKETS)
REJECT_STATUSES = ("400", "429", "503")  # services/scheduler/admission.py
SIZE_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


class SchedulerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._add_vllm_metrics(model_name)
        self._add_kv_tier_metrics()
        self._add_disaggregation_metrics()
        self._add_liveness_metrics()
        self._add_step_metrics()

    def _add_vllm_metrics(self, model_name: str) -> None:
        """vLLM's metrics, under its names and label."""
        r, labels = self.registry, ["model_name"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r
        ).labels(model_name)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", labels, registry=r
        ).labels(model_name)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels, registry=r
        ).labels(model_name)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels, registry=r
        ).labels(model_name)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative preemptions.", labels, registry=r
        ).labels(model_name)
        # vLLM's counters of prefix hits outside the device cache (its KV connectors)
        self.external_prefix_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the lower KV tiers and on other workers.",
            labels,
            registry=r,
        ).labels(model_name)
        self.external_prefix_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens loaded from the lower KV tiers or other workers.",
            labels,
            registry=r,
        ).labels(model_name)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time requests spent waiting before first scheduled.",
            labels,
            registry=r,
        ).labels(model_name)

    def _add_kv_tier_metrics(self) -> None:
        """The lower KV tiers of every worker, as the scheduler indexes them."""
        r = self.registry
        self.kv_tier_hits = Counter(
            "skiff_kv_tier_hits",
            "Prompt tokens loaded instead of computed, by origin: the worker's host or disk "
            "tier, or another worker (remote).",
            ["origin"],
            registry=r,
        )
        for origin in ("host", "disk", "remote"):
            self.kv_tier_hits.labels(origin)
        self.kv_tier_usage = Gauge(
            "skiff_kv_tier_usage",
            "Fraction of a worker's lower-tier slots holding a block.",
            ["worker_id", "tier"],
            registry=r,
        )
        self.kv_tier_blocks_lost = Counter(
            "skiff_kv_tier_blocks_lost",
            "Lower-tier blocks a worker reported lost (failed disk write, checksum mismatch): "
            "their prefixes are computed again.",
            registry=r,
        )

    def _add_disaggregation_metrics(self) -> None:
        """Prefill/decode disaggregation: hand-overs, their KV transfers, requests by role."""
        r = self.registry
        self.pd_handoffs = Counter(
            "skiff_pd_handoffs",
            "Requests handed from a prefill worker to a decode worker, by outcome: its KV "
            "transferred, recomputed (the transfer failed), or local (no decode worker).",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.pd_handoffs.labels(outcome)
        self.pd_transfer_bytes = Counter(
            "skiff_pd_transfer_bytes",
            "KV bytes decode workers fetched from prefill workers.",
            registry=r,
        )
        self.pd_transfer_seconds = Histogram(
            "skiff_pd_transfer_seconds",
            "From a hand-over until its KV is in place on the decode worker.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.role_requests = Gauge(
            "skiff_role_requests",
            "Requests on the workers of each role, running or waiting (waiting includes "
            "those whose KV is being fetched).",
            ["role", "state"],
            registry=r,
        )
        for role in WORKER_ROLES:
            for state in ("running", "waiting"):
                self.role_requests.labels(role, state)
        # vLLM's: one sample, its labels the adapters of the running and waiting requests
        # (comma-separated) and the adapters a worker holds at once; its value the time
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self.lora_requests = Gauge(
            "skiff_lora_requests",
            "Requests of each served LoRA adapter, running or waiting.",
            ["adapter", "state"],
            registry=r,
        )

    def _add_liveness_metrics(self) -> None:
        """Workers, gateways and the requests their failures move or end."""
        r = self.registry
        self.workers_ready = Gauge(
            "skiff_workers_ready", "Healthy workers sending heartbeats.", registry=r
        )
        self.migrations = Counter(
            "skiff_request_migrations", "Requests moved off a lost worker.", registry=r
        )
        self.requests_failed = Counter(
            "skiff_requests_failed",
            "Requests ended with an error after the workers running them stalled or were "
            "lost --max-request-failures times.",
            registry=r,
        )
        self.step_timeouts = Counter(
            "skiff_worker_step_timeouts",
            "Steps whose result missed its deadline; the worker is then unhealthy.",
            ["worker_id"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "skiff_worker_healthy",
            "1 while a worker gets requests, 0 from a missed step deadline until it answers "
            "a probe.",
            ["worker_id"],
            registry=r,
        )
        self.worker_messages_dropped = Counter(
            "skiff_worker_messages_dropped",
            "Worker messages dropped, by reason: wrong_sender, the body names another worker "
            "than the subject it came on (a worker publishes only as itself).",
            ["reason"],
            registry=r,
        )
        self.worker_messages_dropped.labels(WRONG_SENDER)
        self.orphans_aborted = Counter(
            "skiff_orphaned_requests_aborted",
            "Requests aborted because their gateway stopped sending heartbeats.",
            registry=r,
        )

    def _add_step_metrics(self) -> None:
        """Per worker step: round trip, execute and idle time, plans, NATS."""
        r = self.registry
        self.step_seconds = Histogram(
            "skiff_step_round_trip_seconds",
            "Plan published to result received, per worker step.",
            ["worker_id"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.execute_seconds = Histogram(
            "skiff_worker_execute_seconds",
            "Worker time per step (inputs, forward, sampling).",
            ["worker_id"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.worker_idle_seconds = Counter(
            "skiff_worker_idle_seconds",
            "Time a worker waited for its next plan: no work, or the scheduler's round trip.",
            ["worker_id"],
            registry=r,
        )
        self.schedule_seconds = Histogram(
            "skiff_schedule_seconds",
            "CPU time of one schedule() + update() pair.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.plan_bytes = Histogram(
            "skiff_plan_bytes", "Encoded BatchPlan size.", buckets=SIZE_BUCKETS, registry=r
        )
        self.rejected = Counter(
            "skiff_requests_rejected", "Submissions rejected.", ["reason"], registry=r
        )
        for status in REJECT_STATUSES:  # at 0 from the start: rate() has data before any
            self.rejected.labels(status)
        self.plans_in_flight = Gauge(
            "skiff_worker_plans_in_flight",
            "Plans published to a worker whose results have not come back.",
            ["worker_id"],
            registry=r,
        )
        self.nats_round_trip = Histogram(
            "skiff_nats_round_trip_seconds",
            "Per step: plan published (or, with two plans in flight, the previous result "
            "received) to result received, less the worker's execute and idle time.",
            ["worker_id"],
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self.nats_connected = Gauge(
            "skiff_nats_connected", "1 while connected to NATS.", registry=r
        )
