"""What the scheduler reports: its heartbeat, the stats snapshot for tests and operators, and
the Prometheus gauges and counters, all read from the workers' stats snapshots."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import Counter

from services.scheduler.lora_registry import LoRARegistry
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.prefix_summaries import pool_prefix_summary
from services.scheduler.worker_pool import WorkerPool
from shared.prefix_summary import DEFAULT_MAX_BYTES
from shared.wire import WORKER_ROLES, SchedulerHeartbeat, SchedulerStats, WorkerStats


class Telemetry:
    def __init__(
        self,
        epoch: str,
        pool: WorkerPool,
        placement: Placement,
        metrics: SchedulerMetrics,
        prefix_summary_max_bytes: int = DEFAULT_MAX_BYTES,
        loras: LoRARegistry | None = None,
    ) -> None:
        self.epoch = epoch
        self.pool = pool
        self.placement = placement
        self.metrics = metrics
        self.prefix_summary_max_bytes = prefix_summary_max_bytes
        self.loras = loras if loras is not None else LoRARegistry({})
        self._counted: dict[Counter, int] = {}  # totals already added to each counter
        self._lora_labels: set[tuple[str, str]] = set()  # skiff_lora_requests' label sets
        self._lora_info: tuple[str, str, str] | None = None  # vllm:lora_requests_info's

    def heartbeat(self, leaving: bool = False) -> SchedulerHeartbeat:
        """Ready workers are the healthy ones; a leaving scheduler reports none, so gateways
        stop sending to it (nor a prefix summary)."""
        stats = list(self.pool.make_stats().values())
        block_size, summary = (
            (0, b"") if leaving else pool_prefix_summary(self.pool, self.prefix_summary_max_bytes)
        )
        return SchedulerHeartbeat(
            epoch=self.epoch,
            num_ready_workers=0 if leaving else self.pool.num_healthy,
            model=self.pool.model,
            max_model_len=self.pool.max_model_len,
            num_running=sum(s.num_running for s in stats),
            num_waiting=self._num_waiting(stats),
            kv_cache_usage=max((s.kv_cache_usage for s in stats), default=0.0),
            leaving=leaving,
            block_size=block_size,
            prefix_summary=summary,
            lora_adapters=self.loras.paths,
        )

    def stats(self, num_orphans_aborted: int = 0) -> SchedulerStats:
        return SchedulerStats(
            epoch=self.epoch,
            num_requests=self.placement.num_requests,
            workers={
                wid: msgspec.structs.replace(
                    w.core.make_stats(), statuses=w.core.request_statuses(), healthy=w.healthy
                )
                for wid, w in self.pool.workers.items()
            },
            num_orphans_aborted=num_orphans_aborted,
        )

    def refresh_gauges(self) -> None:
        by_worker = self.pool.make_stats()
        m, stats = self.metrics, list(by_worker.values())
        m.running.set(sum(s.num_running for s in stats))
        m.waiting.set(self._num_waiting(stats))
        m.kv_usage.set(max((s.kv_cache_usage for s in stats), default=0.0))
        m.workers_ready.set(self.pool.num_healthy)
        totals = {
            m.prefix_queries: sum(s.prefix_cache_queries for s in stats),
            m.prefix_hits: sum(s.prefix_cache_hits for s in stats),
            m.preemptions: sum(s.num_preemptions for s in stats),
            m.kv_tier_blocks_lost: sum(s.kv_tier_blocks_lost for s in stats),
        }
        for origin in ("host", "disk", "remote"):
            hits = m.kv_tier_hits.labels(origin)
            totals[hits] = sum(s.kv_tier_hits.get(origin, 0) for s in stats)
        # a worker's lookups below its device cache: the prompt tokens its device cache missed
        tier_hits = sum(sum(s.kv_tier_hits.values()) for s in stats)
        totals[m.external_prefix_hits] = tier_hits
        totals[m.external_prefix_queries] = sum(
            s.prefix_cache_queries - s.prefix_cache_hits
            for s in stats
            if any(s.kv_tier_blocks.values())
        )
        by_role: dict[tuple[str, str], int] = {}
        for wid, s in by_worker.items():
            role = self.pool.workers[wid].role
            for state, num in (("running", s.num_running), ("waiting", s.num_waiting)):
                by_role[role, state] = by_role.get((role, state), 0) + num
            for tier, num_slots in s.kv_tier_blocks.items():
                if num_slots:
                    used = s.kv_tier_used_blocks.get(tier, 0)
                    m.kv_tier_usage.labels(wid, tier).set(used / num_slots)
        for role in WORKER_ROLES:
            for state in ("running", "waiting"):
                m.role_requests.labels(role, state).set(by_role.get((role, state), 0))
        self._refresh_lora_gauges()
        for counter, total in totals.items():  # counters follow totals kept by the cores
            counted = self._counted.get(counter, 0)
            counter.inc(max(total - counted, 0))
            self._counted[counter] = max(total, counted)

    def _refresh_lora_gauges(self) -> None:
        """Requests per adapter (every served one, 0 when none) and vLLM's info sample."""
        counts: dict[tuple[str, str], int] = {}
        for w in self.pool.workers.values():
            for state, requests in (("running", w.core.running), ("waiting", w.core.waiting)):
                for r in requests:
                    if r.lora_name is not None:
                        counts[r.lora_name, state] = counts.get((r.lora_name, state), 0) + 1
        for r in self.placement.unplaced:
            if r.lora_name is not None:
                counts[r.lora_name, "waiting"] = counts.get((r.lora_name, "waiting"), 0) + 1
        # Samples are set before stale ones go: a scrape in between (the metrics server has
        # a thread of its own) never sees none.
        m = self.metrics
        labels = {(name, state) for name in self.loras.names for state in ("running", "waiting")}
        for name, state in labels:
            m.lora_requests.labels(name, state).set(counts.get((name, state), 0))
        for name, state in self._lora_labels - labels:  # unloaded adapters
            m.lora_requests.remove(name, state)
        self._lora_labels = labels
        max_lora = max((w.hello.max_loras for w in self.pool.workers.values()), default=0)
        running = sorted({name for (name, state) in counts if state == "running"})
        waiting = sorted({name for (name, state) in counts if state == "waiting"})
        info = (str(max_lora), ",".join(running), ",".join(waiting))
        m.lora_requests_info.labels(*info).set(time.time())
        if self._lora_info not in (None, info):
            m.lora_requests_info.remove(*self._lora_info)
        self._lora_info = info

    def _num_waiting(self, stats: list[WorkerStats]) -> int:
        return sum(s.num_waiting for s in stats) + len(self.placement.unplaced)
