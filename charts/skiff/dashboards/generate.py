"""The chart's Grafana dashboards, as code (grafana-foundation-sdk): `skiff.json` (overview:
requests, tenants, latency, KV cache, lower KV tiers and shard routing, prefill/decode
disaggregation, scheduling) and
`skiff-workers.json` (per worker: step phases, tokens and batch, KV blocks, memory, busy
fraction, NATS round trip, KV tier capacity, usage and traffic).

    python charts/skiff/dashboards/generate.py          # write the JSON next to this file
    python charts/skiff/dashboards/generate.py --check  # exit 1 if the committed JSON differs

Panels are declared as data (`Board`, `Row`, `Panel`) and laid out left to right, row by row;
`Board.expressions()` lists every query, which tests run against a live Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    GridPos,
    VariableRefresh,
    VariableSort,
)

HERE = Path(__file__).resolve().parent
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model_name=~"$model_name"'
WORKER = 'worker_id=~"$worker_id"'
RATE = "[$__rate_interval]"


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    width: int = 8
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    height: int = 8


@dataclass
class Row:
    title: str
    panels: list[Panel]


@dataclass
class Board:
    file: str
    uid: str
    title: str
    description: str
    tags: list[str]
    variables: list[tuple[str, str, str]]  # (name, label, label_values() query)
    rows: list[Row] = field(default_factory=list)

    def expressions(self) -> list[str]:
        return [expr for row in self.rows for p in row.panels for expr, _ in p.targets]

    def build(self) -> dict[str, Any]:
        b = (
            dashboard.Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .tags(self.tags)
            .editable()
            .refresh("30s")
            .time("now-1h", "now")
            .timezone("browser")
            .tooltip(DashboardCursorSync.CROSSHAIR)
            .with_variable(
                dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
            )
        )
        for name, label, query in self.variables:
            b = b.with_variable(
                dashboard.QueryVariable(name)
                .label(label)
                .datasource(DS)
                .query(query)
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                .include_all(True)
                .multi(True)
                .all_value(".*")
                .sort(VariableSort.ALPHABETICAL_ASC)
            )
        y, next_id = 0, 1
        for row in self.rows:
            b = b.with_row(
                dashboard.Row(row.title).id(next_id).grid_pos(GridPos(h=1, w=24, x=0, y=y))
            )
            next_id, y, x = next_id + 1, y + 1, 0
            for p in row.panels:
                if x + p.width > 24:
                    x, y = 0, y + p.height
                b = b.with_panel(_panel(p, next_id, GridPos(h=p.height, w=p.width, x=x, y=y)))
                next_id, x = next_id + 1, x + p.width
            y += max(p.height for p in row.panels)
        board: dict[str, Any] = json.loads(json.dumps(b.build(), cls=JSONEncoder))
        for variable in board["templating"]["list"]:  # what Grafana's editor shows as the query
            if variable["type"] == "query":
                variable["definition"] = variable["query"]
        return board

    def render(self) -> str:
        return json.dumps(self.build(), indent=2) + "\n"


def _panel(p: Panel, panel_id: int, pos: GridPos) -> Any:
    builder: Any = stat.Panel() if p.kind == "stat" else timeseries.Panel()
    builder = builder.id(panel_id).title(p.title).datasource(DS).grid_pos(pos).unit(p.unit)
    if p.description:
        builder = builder.description(p.description)
    if p.kind == "timeseries":
        builder = builder.legend(
            common.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        ).tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI))
    for i, (expr, legend) in enumerate(p.targets):
        query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        builder = builder.with_target(query.datasource(DS))
    return builder


def _sel(selector: str) -> str:
    return "{" + selector + "}" if selector else ""


def rate(metric: str, selector: str = "", by: str = "") -> str:
    """sum [by (...)] (rate(metric{selector}[$__rate_interval]))"""
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{_sel(selector)}{RATE}))"


def mean(histogram: str, selector: str = "", by: str = "") -> str:
    """The mean of a histogram's observations in the window."""
    return f"{rate(histogram + '_sum', selector, by)} / {rate(histogram + '_count', selector, by)}"


def quantiles(
    metric: str,
    selector: str = "",
    qs: tuple[float, ...] = (0.5, 0.9, 0.99),
    by: str = "le",
    legend: str = "",
) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, {rate(metric + '_bucket', selector, by)})",
            f"p{round(q * 100)}{legend}",
        )
        for q in qs
    ]


def per_worker(
    metric: str, qs: tuple[float, ...] = (0.5, 0.99), extra: str = ""
) -> list[tuple[str, str]]:
    selector = WORKER + (f", {extra}" if extra else "")
    return quantiles(metric, selector, qs, "le, worker_id", " {{worker_id}}")


def overview() -> Board:
    m = MODEL
    return Board(
        file="skiff.json",
        uid="skiff-overview",
        title="skiff",
        description="skiff LLM serving: gateway, scheduler and workers (vLLM metric names).",
        tags=["skiff", "llm", "vllm"],
        variables=[("model_name", "Model", "label_values(vllm:num_requests_running, model_name)")],
        rows=[
            Row(
                "Requests",
                [
                    Panel(
                        "Finished requests by reason",
                        "reqps",
                        [
                            (
                                rate("vllm:request_success_total", m, "finished_reason"),
                                "{{finished_reason}}",
                            )
                        ],
                        description="Gateway: finished requests per second by finish reason "
                        "(stop, length, abort, ...).",
                    ),
                    Panel(
                        "Running and waiting requests",
                        "short",
                        [
                            (f"sum(vllm:num_requests_running{{{m}}})", "running"),
                            (f"sum(vllm:num_requests_waiting{{{m}}})", "waiting"),
                            ("sum(skiff_gateway_requests_in_flight)", "in flight at gateways"),
                        ],
                    ),
                    Panel(
                        "Tokens per second",
                        "short",
                        [
                            (rate("vllm:prompt_tokens_total", m), "prompt"),
                            (rate("vllm:generation_tokens_total", m), "generation"),
                        ],
                    ),
                    Panel(
                        "Rejected submissions by status",
                        "reqps",
                        [(rate("skiff_requests_rejected_total", by="reason"), "{{reason}}")],
                        description="Scheduler refusals (429 queue full, 503 draining or no "
                        "worker, ...).",
                    ),
                    Panel(
                        "Client disconnects and stop strings",
                        "reqps",
                        [
                            (rate("skiff_gateway_client_disconnects_total"), "client disconnects"),
                            (rate("skiff_gateway_stop_string_aborts_total"), "stop strings"),
                        ],
                    ),
                    Panel(
                        "Gateway HTTP responses by status",
                        "reqps",
                        [(rate("skiff_gateway_http_requests_total", by="status"), "{{status}}")],
                    ),
                ],
            ),
            Row(
                "Tenants (API keys)",
                [
                    Panel(
                        "Requests by tenant and outcome",
                        "reqps",
                        [
                            (
                                rate("skiff_gateway_tenant_requests_total", by="tenant, outcome"),
                                "{{tenant}} {{outcome}}",
                            )
                        ],
                        width=6,
                        description="Gateway: requests of each tenant (the key file's names; "
                        "anonymous without keys), answered (ok, error) or refused by a limit "
                        "(requests_per_minute, tokens_per_minute, max_concurrency: 429) or a "
                        "right (model_not_allowed, not_admin: 403). Unknown keys (401) are in "
                        "the HTTP responses by status.",
                    ),
                    Panel(
                        "Refused requests by tenant",
                        "reqps",
                        [
                            (
                                rate(
                                    "skiff_gateway_tenant_requests_total",
                                    'outcome!~"ok|error"',
                                    "tenant, outcome",
                                ),
                                "{{tenant}} {{outcome}}",
                            )
                        ],
                        width=6,
                    ),
                    Panel(
                        "Tokens per second by tenant",
                        "short",
                        [
                            (
                                rate("skiff_gateway_tenant_tokens_total", by="tenant, kind"),
                                "{{tenant}} {{kind}}",
                            )
                        ],
                        width=6,
                        description="Prompt tokens (once per prompt, when the engine accepts "
                        "the request) and generated tokens (as they come): what "
                        "tokens_per_minute counts.",
                    ),
                    Panel(
                        "Requests in flight by tenant",
                        "short",
                        [
                            (
                                "sum by (tenant) (skiff_gateway_tenant_requests_in_flight)",
                                "{{tenant}}",
                            )
                        ],
                        width=6,
                        description="What max_concurrency limits: a stream counts until its "
                        "last event or until its client leaves.",
                    ),
                ],
            ),
            Row(
                "Latency",
                [
                    Panel(
                        "Time to first token",
                        "s",
                        quantiles("vllm:time_to_first_token_seconds", m),
                        width=6,
                    ),
                    Panel(
                        "Inter-token latency",
                        "s",
                        quantiles("vllm:inter_token_latency_seconds", m),
                        width=6,
                    ),
                    Panel(
                        "End-to-end request latency",
                        "s",
                        quantiles("vllm:e2e_request_latency_seconds", m),
                        width=6,
                    ),
                    Panel(
                        "Queue time",
                        "s",
                        quantiles("vllm:request_queue_time_seconds", m),
                        width=6,
                        description="Scheduler: arrival to first scheduled.",
                    ),
                ],
            ),
            Row(
                "KV cache and scheduling",
                [
                    Panel(
                        "KV cache usage",
                        "percentunit",
                        [(f"max(vllm:kv_cache_usage_perc{{{m}}})", "KV cache")],
                        width=6,
                    ),
                    Panel(
                        "Prefix cache hit rate",
                        "percentunit",
                        [
                            (
                                f"{rate('vllm:prefix_cache_hits_total', m)} / "
                                f"{rate('vllm:prefix_cache_queries_total', m)}",
                                "hit rate",
                            )
                        ],
                        width=6,
                        description="Share of queried prompt tokens found in the prefix cache.",
                    ),
                    Panel(
                        "Preemptions and migrations",
                        "ops",
                        [
                            (rate("vllm:num_preemptions_total", m), "preemptions"),
                            (rate("skiff_request_migrations_total"), "moved off lost workers"),
                        ],
                        width=6,
                    ),
                    Panel(
                        "Workers ready",
                        "none",
                        [("max(skiff_workers_ready)", "workers")],
                        width=6,
                        kind="stat",
                        description="Workers whose NATS heartbeats the scheduler receives.",
                    ),
                ],
            ),
            Row(
                "KV tiers and shard routing",
                [
                    Panel(
                        "Prompt tokens loaded from lower tiers",
                        "short",
                        [(rate("skiff_kv_tier_hits_total", by="origin"), "{{origin}}")],
                        description="Scheduler: prompt tokens per second loaded instead of "
                        "computed, by origin: the worker's host or disk tier, or another worker "
                        "(remote, over the KV-transfer path).",
                    ),
                    Panel(
                        "Lower-tier prefix lookups",
                        "short",
                        [
                            (rate("vllm:external_prefix_cache_queries_total", m), "queried"),
                            (rate("vllm:external_prefix_cache_hits_total", m), "hit"),
                        ],
                        description="Prompt tokens per second that the device prefix caches "
                        "missed on workers with lower tiers (queried) and those found in a lower "
                        "tier or on another worker (hit): vLLM's external prefix cache.",
                    ),
                    Panel(
                        "Lower-tier blocks lost",
                        "ops",
                        [(rate("skiff_kv_tier_blocks_lost_total"), "blocks lost")],
                        description="Blocks workers reported lost (a failed disk write or read, "
                        "a checksum mismatch): their prefixes are computed again.",
                    ),
                    Panel(
                        "Requests by shard and routing reason",
                        "reqps",
                        [
                            (
                                rate("skiff_gateway_shard_requests_total", by="shard, reason"),
                                "shard {{shard}} {{reason}}",
                            )
                        ],
                        width=12,
                        description="Gateways: prefix (the shard's workers hold the longest "
                        "prefix of the prompt) or load (no match, load routing, or the prefix "
                        "shard too far above the least loaded).",
                    ),
                    Panel(
                        "Prompt tokens matched by prefix routing",
                        "short",
                        [
                            (
                                rate("skiff_gateway_shard_prefix_matched_tokens_total", by="shard"),
                                "shard {{shard}}",
                            )
                        ],
                        width=12,
                        description="Gateways: prompt tokens per second of the requests routed "
                        "to each shard that its prefix summary held.",
                    ),
                ],
            ),
            Row(
                "Prefill/decode disaggregation",
                [
                    Panel(
                        "Hand-overs by outcome",
                        "ops",
                        [(rate("skiff_pd_handoffs_total", by="outcome"), "{{outcome}}")],
                        width=6,
                        description="Scheduler: long prompts prefilled on a prefill worker, by "
                        "what became of their KV: transferred to a decode worker, recomputed "
                        "there (the transfer failed), or local (no decode worker: decoded "
                        "where it was prefilled).",
                    ),
                    Panel(
                        "KV transferred",
                        "Bps",
                        [(rate("skiff_pd_transfer_bytes_total"), "bytes")],
                        width=6,
                        description="KV bytes per second moved from prefill to decode workers "
                        "over the KV-transfer port.",
                    ),
                    Panel(
                        "Hand-over latency",
                        "s",
                        quantiles("skiff_pd_transfer_seconds", qs=(0.5, 0.99)),
                        width=6,
                        description="Hand-over until the KV is in place on the decode worker.",
                    ),
                    Panel(
                        "Requests by role",
                        "short",
                        [
                            (
                                "sum by (role, state) (skiff_role_requests)",
                                "{{role}} {{state}}",
                            )
                        ],
                        width=6,
                        description="Running and waiting requests on the mixed, prefill and "
                        "decode workers; prefill waiting drives the prefill workers' autoscaler.",
                    ),
                ],
            ),
            Row(
                "LoRA adapters",
                [
                    Panel(
                        "Requests per adapter",
                        "short",
                        [
                            (
                                "sum by (adapter, state) (skiff_lora_requests)",
                                "{{adapter}} {{state}}",
                            )
                        ],
                        width=12,
                        description="Running and waiting requests of each served LoRA adapter "
                        "(docs/lora.md).",
                    ),
                    Panel(
                        "Adapters in use",
                        "short",
                        [
                            (
                                "count by (running_lora_adapters) (vllm:lora_requests_info)",
                                "{{running_lora_adapters}}",
                            )
                        ],
                        width=12,
                        description="vLLM's lora_requests_info: the adapters of the running "
                        "requests (comma-separated).",
                    ),
                ],
            ),
            Row(
                "Steps",
                [
                    Panel(
                        "Step round trip vs worker execute time",
                        "s",
                        [
                            *quantiles(
                                "skiff_step_round_trip_seconds",
                                "",
                                (0.5, 0.99),
                                "le, worker_id",
                                " round trip {{worker_id}}",
                            ),
                            *quantiles(
                                "skiff_worker_execute_seconds",
                                "",
                                (0.5, 0.99),
                                "le, worker_id",
                                " execute {{worker_id}}",
                            ),
                        ],
                        description="Round trip: plan published to result received. Execute: the "
                        "worker's own time (inputs, forward, sampling). The gap is NATS and "
                        "scheduling overhead.",
                    ),
                    Panel(
                        "Scheduler CPU per step",
                        "s",
                        quantiles("skiff_schedule_seconds", qs=(0.5, 0.99)),
                        description="schedule() + update() per step; one scheduler serves all "
                        "workers.",
                    ),
                    Panel(
                        "Plan size",
                        "bytes",
                        [
                            *quantiles("skiff_plan_bytes", qs=(0.5, 0.99)),
                            (mean("skiff_plan_bytes"), "mean"),
                        ],
                    ),
                    Panel(
                        "Submit round trip (gateway to scheduler)",
                        "s",
                        quantiles("skiff_gateway_submit_seconds", qs=(0.5, 0.99)),
                    ),
                    Panel(
                        "Prompt tokens per request",
                        "short",
                        quantiles("vllm:request_prompt_tokens", m),
                    ),
                    Panel(
                        "Generated tokens per request",
                        "short",
                        quantiles("vllm:request_generation_tokens", m),
                    ),
                ],
            ),
        ],
    )


def workers() -> Board:
    w = WORKER
    return Board(
        file="skiff-workers.json",
        uid="skiff-workers",
        title="skiff workers",
        description="skiff workers and their devices: step phases, KV blocks, memory, busy time.",
        tags=["skiff", "llm", "gpu"],
        variables=[
            ("worker_id", "Worker", "label_values(skiff_worker_step_seconds_count, worker_id)")
        ],
        rows=[
            Row(
                "Steps",
                [
                    Panel(
                        "Step phases (mean per step)",
                        "s",
                        [
                            (
                                mean("skiff_worker_step_phase_seconds", w, "worker_id, phase"),
                                "{{worker_id}} {{phase}}",
                            )
                        ],
                        width=12,
                        description="prepare (plan diff, input tensors), forward (model and "
                        "logits), sample (sampler), write_back (tokens into the batch). On "
                        "CUDA forward and sample are device time (CUDA events).",
                    ),
                    Panel("Step time", "s", per_worker("skiff_worker_step_seconds"), width=12),
                    Panel(
                        "Busy fraction",
                        "percentunit",
                        [
                            (
                                f"1 - {rate('skiff_worker_idle_seconds_total', w, 'worker_id')}",
                                "{{worker_id}}",
                            )
                        ],
                        description="Share of time a worker is not waiting for its next plan (the "
                        "scheduler's skiff_worker_idle_seconds).",
                    ),
                    Panel(
                        "Tokens per step",
                        "short",
                        [(mean("vllm:iteration_tokens_total", w, "worker_id"), "{{worker_id}}")],
                    ),
                    Panel(
                        "Requests per step",
                        "short",
                        [(mean("skiff_worker_batch_size", w, "worker_id"), "{{worker_id}}")],
                    ),
                    Panel(
                        "Forward passes: CUDA graph vs eager",
                        "ops",
                        [
                            (
                                rate("skiff_worker_forward_steps_total", w, "worker_id, mode"),
                                "{{worker_id}} {{mode}}",
                            )
                        ],
                    ),
                    Panel(
                        "Sampler time",
                        "s",
                        per_worker("skiff_worker_step_phase_seconds", extra='phase="sample"'),
                    ),
                    Panel(
                        "NATS round trip",
                        "s",
                        per_worker("skiff_nats_round_trip_seconds"),
                        description="Scheduler: plan published (or the previous result received) "
                        "to result received, less the worker's execute and idle time.",
                    ),
                ],
            ),
            Row(
                "KV cache and memory",
                [
                    Panel(
                        "KV blocks",
                        "short",
                        [
                            (
                                f"sum by (worker_id, state) (skiff_worker_kv_cache_blocks{{{w}}})",
                                "{{worker_id}} {{state}}",
                            )
                        ],
                    ),
                    Panel(
                        "Device memory",
                        "bytes",
                        [
                            (
                                f"sum by (worker_id, kind) "
                                f"(skiff_worker_device_memory_bytes{{{w}}})",
                                "{{worker_id}} {{kind}}",
                            )
                        ],
                        description="kv_cache: the KV tensors; on CUDA also allocated and reserved "
                        "by torch, and the device's total.",
                    ),
                    Panel(
                        "Worker process memory",
                        "bytes",
                        [
                            (
                                "sum by (instance) (process_resident_memory_bytes "
                                "and on (instance) skiff_worker_model_load_seconds)",
                                "{{instance}}",
                            )
                        ],
                    ),
                    Panel(
                        "Plans in flight",
                        "short",
                        [
                            (
                                f"sum by (worker_id) (skiff_worker_plans_in_flight{{{w}}})",
                                "{{worker_id}}",
                            )
                        ],
                        width=6,
                    ),
                    Panel(
                        "Model load time",
                        "s",
                        [("max by (instance) (skiff_worker_model_load_seconds)", "{{instance}}")],
                        width=6,
                        kind="stat",
                    ),
                    Panel(
                        "Connected to NATS",
                        "none",
                        [(f"min by (worker_id) (skiff_nats_connected{{{w}}})", "{{worker_id}}")],
                        width=6,
                        kind="stat",
                    ),
                    Panel(
                        "Scheduler epoch changes",
                        "none",
                        [
                            (
                                f"sum by (worker_id) (increase("
                                f"skiff_worker_scheduler_epoch_changes_total{{{w}}}[1h]))",
                                "{{worker_id}}",
                            )
                        ],
                        width=6,
                        kind="stat",
                        description="Plans of a new scheduler epoch in the last hour: the "
                        "scheduler restarted or a standby took over.",
                    ),
                ],
            ),
            Row(
                "KV tiers",
                [
                    Panel(
                        "Tier capacity",
                        "short",
                        [
                            (
                                f"sum by (worker_id, tier) (skiff:kv_tier_blocks{{{w}}})",
                                "{{worker_id}} {{tier}}",
                            )
                        ],
                        description="KV blocks each tier holds at most: device, host and disk "
                        "(0: off; a disk tier that failed to set up is off).",
                    ),
                    Panel(
                        "Lower-tier usage",
                        "percentunit",
                        [
                            (
                                f"max by (worker_id, tier) (skiff_kv_tier_usage{{{w}}}) or "
                                f"max by (worker_id, tier) "
                                f'(0 * skiff:kv_tier_blocks{{{w}, tier=~"host|disk"}})',
                                "{{worker_id}} {{tier}}",
                            )
                        ],
                        description="Scheduler: share of each lower tier's slots holding a "
                        "block (0 where the worker has the tier off); a full tier drops its "
                        "least recently used blocks.",
                    ),
                    Panel(
                        "KV offloaded by tier",
                        "Bps",
                        [
                            (
                                rate("skiff:kv_offload_bytes_total", w, "worker_id, tier"),
                                "{{worker_id}} {{tier}}",
                            )
                        ],
                        description="Bytes copied down: device to host, host to disk.",
                    ),
                    Panel(
                        "KV loaded by source",
                        "Bps",
                        [
                            (
                                rate("skiff:kv_load_bytes_total", w, "worker_id, source"),
                                "{{worker_id}} {{source}}",
                            )
                        ],
                        description="Bytes loaded into the device pool, alongside the forward "
                        "pass: from host, disk, or another worker (remote).",
                    ),
                    Panel(
                        "KV-transfer bytes served",
                        "Bps",
                        [
                            (
                                rate("skiff:kv_transfer_served_bytes_total", w, "worker_id"),
                                "{{worker_id}}",
                            )
                        ],
                        description="Bytes this worker's KV-transfer server sent to other workers.",
                    ),
                    Panel(
                        "KV load failures and disk errors",
                        "ops",
                        [
                            (
                                rate("skiff:kv_load_failures_total", w, "worker_id, reason"),
                                "{{worker_id}} load {{reason}}",
                            ),
                            (
                                rate("skiff:kv_disk_tier_errors_total", w, "worker_id, op"),
                                "{{worker_id}} disk {{op}}",
                            ),
                        ],
                        description="Failed loads by reason (checksum, io, transfer: the "
                        "prefix is computed instead) and disk-tier errors by operation (setup: "
                        "the tier is off; write, read: the slot is lost).",
                    ),
                ],
            ),
            Row(
                "LoRA adapters",
                [
                    Panel(
                        "Adapter loads and evictions",
                        "ops",
                        [
                            (
                                rate("skiff_worker_lora_loads_total", w, "worker_id"),
                                "{{worker_id}} loads",
                            ),
                            (
                                rate("skiff_worker_lora_evictions_total", w, "worker_id"),
                                "{{worker_id}} evictions",
                            ),
                        ],
                        width=12,
                        description="Adapters read into a slot, and adapters that gave theirs "
                        "up (least recently used first): many evictions mean too few slots "
                        "(--max-loras) for the adapters in use (docs/lora.md).",
                    ),
                    Panel(
                        "Adapter slots in use",
                        "short",
                        [
                            (
                                "sum by (worker_id) "
                                f'(skiff_worker_lora_slots{{{w}, state="used"}})',
                                "{{worker_id}}",
                            )
                        ],
                        width=12,
                        description="Slots holding an adapter, of --max-loras.",
                    ),
                ],
            ),
        ],
    )


BOARDS = (overview, workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON files differ")
    check = parser.parse_args().check
    stale = []
    for make in BOARDS:
        board = make()
        path, text = HERE / board.file, board.render()
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        sys.exit(
            f"out of date: {', '.join(stale)}; run python {Path(__file__).relative_to(Path.cwd())}"
        )


if __name__ == "__main__":
    main()
