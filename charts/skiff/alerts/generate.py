"""skiff's Prometheus alerts, declared once and written twice: `skiff.rules.yaml` (a plain rule
file, thresholds at their defaults, for Prometheus and `promtool test rules`) and the chart's
`templates/prometheusrule.yaml` (a PrometheusRule whose thresholds and worker job come from the
release's values).

    python charts/skiff/alerts/generate.py          # write both files
    python charts/skiff/alerts/generate.py --check  # exit 1 if either differs

An alert fires when all its conditions hold (`value op threshold`, joined by `and`); each
`value` is a query that returns data on a serving stack, which tests check against a live
Prometheus.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "skiff.rules.yaml"
TEMPLATE = HERE.parent / "templates" / "prometheusrule.yaml"
VALUES = ".Values.metrics.prometheusRule"


@dataclass(frozen=True)
class Setting:
    """A threshold the chart takes from `metrics.prometheusRule.<key>`."""

    key: str
    default: float


@dataclass(frozen=True)
class Condition:
    value: str
    op: str
    threshold: float | Setting


@dataclass(frozen=True)
class Alert:
    name: str
    conditions: tuple[Condition, ...]
    for_: str
    severity: str
    summary: str
    runbook: str


TTFT_P95 = Setting("ttftP95Seconds", 2.0)
ERROR_RATIO = Setting("errorRatio", 0.05)
KV_SATURATED = Setting("kvCacheUsage", 0.9)
STEP_REGRESSION = Setting("stepTimeRegressionFactor", 1.5)
PREEMPTIONS = Setting("preemptionsPerSecond", 1.0)
WORKER_JOB = "$WORKER_JOB"  # the workers' scrape job: skiff-worker, or the release's Service
BY = "namespace, model_name"
HTTP = "skiff_gateway_http_requests_total"


def step_mean(window: str) -> str:
    s, c = "skiff_worker_step_seconds_sum", "skiff_worker_step_seconds_count"
    return (
        f"sum by (namespace, worker_id) (rate({s}[{window}])) "
        f"/ sum by (namespace, worker_id) (rate({c}[{window}]))"
    )


ALERTS = (
    Alert(
        "SkiffWorkerDown",
        (Condition(f'up{{job="{WORKER_JOB}"}}', "==", 0),),
        "2m",
        "critical",
        "Worker {{ $labels.instance }} has not answered a scrape for 2 minutes.",
        "kubectl describe pod and logs --previous of the worker: OOM, GPU lost (Xid in the "
        "node's dmesg), or a wedged step (its /health); the scheduler has moved its requests.",
    ),
    Alert(
        "SkiffWorkerFlapping",
        (Condition(f'changes(process_start_time_seconds{{job="{WORKER_JOB}"}}[30m])', ">=", 3),),
        "0m",
        "warning",
        "Worker {{ $labels.instance }} restarted {{ $value }} times in 30 minutes.",
        "Read the worker's previous logs for the crash (CUDA error, OOM while loading, NATS "
        "credentials); cordon the node if only workers on it flap.",
    ),
    Alert(
        "SkiffQueueGrowingKVSaturated",
        (
            Condition(f"sum by ({BY}) (vllm:num_requests_waiting)", ">", 0),
            Condition(f"sum by ({BY}) (deriv(vllm:num_requests_waiting[5m]))", ">", 0),
            Condition(f"max by ({BY}) (vllm:kv_cache_usage_perc)", ">", KV_SATURATED),
        ),
        "10m",
        "warning",
        "{{ $labels.model_name }}: the queue keeps growing while the KV cache is full.",
        "Add workers (worker.replicas, or the KEDA trigger's threshold), or lower max_num_seqs "
        "or max_model_len; check the gateways for a client that floods.",
    ),
    Alert(
        "SkiffTTFTHigh",
        (
            Condition(
                f"histogram_quantile(0.95, sum by ({BY}, le) "
                "(rate(vllm:time_to_first_token_seconds_bucket[5m])))",
                ">",
                TTFT_P95,
            ),
        ),
        "10m",
        "warning",
        "{{ $labels.model_name }}: time to first token p95 is {{ $value | humanize }} s, "
        "over the SLO.",
        "Queue time (vllm:request_queue_time_seconds) high: add workers; prefill slow: look for "
        "long prompts (vllm:request_prompt_tokens) and the step-phase panels of the workers board.",
    ),
    Alert(
        "SkiffErrorRate",
        (
            Condition(
                f'(sum by (namespace) (rate({HTTP}{{status=~"5.."}}[5m])) '
                f"or sum by (namespace) (rate({HTTP}[5m])) * 0) "
                f"/ sum by (namespace) (rate({HTTP}[5m]))",
                ">",
                ERROR_RATIO,
            ),
        ),
        "5m",
        "critical",
        "{{ $value | humanizePercentage }} of gateway responses are 5xx.",
        "503: no scheduler or worker ready (check skiff_workers_ready and NATS); 500: a gateway "
        "bug, its logs carry the request id; 504: steps time out (skiff_worker_step_timeouts).",
    ),
    Alert(
        "SkiffStepTimeRegression",
        (Condition(f"({step_mean('15m')}) / ({step_mean('6h')})", ">", STEP_REGRESSION),),
        "15m",
        "warning",
        "Worker {{ $labels.worker_id }}: mean step time is {{ $value | humanize }}x its "
        "6-hour mean.",
        "Compare the step phases on the workers board: forward up means the device (thermal "
        "throttling, a noisy neighbour, lost CUDA graphs); prepare or sample up means the host.",
    ),
    Alert(
        "SkiffNatsDisconnected",
        (Condition("skiff_nats_connected", "==", 0),),
        "1m",
        "critical",
        "{{ $labels.job }} {{ $labels.instance }} has been disconnected from NATS for 1 minute.",
        "Check the NATS pods and their logs (authorization errors: the credentials Secret), "
        "and the NetworkPolicy between the service and NATS.",
    ),
    Alert(
        "SkiffSchedulerRestarted",
        (
            Condition(
                "sum by (namespace) (increase(skiff_worker_scheduler_epoch_changes_total[10m]))",
                ">",
                0,
            ),
        ),
        "0m",
        "warning",
        "Workers received plans of a new scheduler epoch: a scheduler restarted or a standby "
        "took over.",
        "Look for the old scheduler's exit in its previous logs (OOM, lost Lease); requests in "
        "flight were resubmitted by the gateways.",
    ),
    Alert(
        "SkiffPreemptionStorm",
        (Condition(f"sum by ({BY}) (rate(vllm:num_preemptions_total[5m]))", ">", PREEMPTIONS),),
        "10m",
        "warning",
        "{{ $labels.model_name }}: {{ $value | humanize }} preemptions per second.",
        "The KV cache is too small for the load: add workers or KV cache (kv_cache_gib), or "
        "lower max_num_seqs so that fewer requests share it.",
    ),
    Alert(
        "SkiffKVDiskTierErrors",
        (
            # a setup error (at start) turns the tier off for the process's life: its count;
            # write and read errors: those of the last 10 minutes
            Condition(
                "(sum by (namespace, worker_id, op) "
                '(increase(skiff:kv_disk_tier_errors_total{op!="setup"}[10m])) '
                "or sum by (namespace, worker_id, op) "
                '(skiff:kv_disk_tier_errors_total{op="setup"}))',
                ">",
                0,
            ),
        ),
        "0m",
        "warning",
        "Worker {{ $labels.worker_id }}: KV disk tier {{ $labels.op }} errors.",
        "setup: the disk tier is off until the worker restarts (worker.kvOffloading.diskPath "
        "not writable by the worker, or no room for its preallocated file of diskGiB); write "
        "or read, in the last 10 minutes: the disk fails (the node's kernel log) and each lost "
        "slot's prefix is computed again. docs/kv-cache.md.",
    ),
)


def threshold(t: float | Setting, chart: bool) -> str:
    if not isinstance(t, Setting):
        return f"{t:g}"
    return f"{{{{ {VALUES}.{t.key} }}}}" if chart else f"{t.default:g}"


def rules(chart: bool) -> list[dict]:
    """The rule group's rules; `chart`: thresholds and the worker job as Helm expressions, and
    Prometheus' own `{{` escaped."""
    job = '{{ include "skiff.fullname" . }}-worker' if chart else "skiff-worker"

    def text(s: str) -> str:
        return s.replace("{{", '{{ "{{" }}') if chart else s

    out = []
    for a in ALERTS:
        expr = " and ".join(
            f"{c.value.replace(WORKER_JOB, job)} {c.op} {threshold(c.threshold, chart)}"
            for c in a.conditions
        )
        rule = {"alert": a.name, "expr": expr}
        if a.for_ != "0m":
            rule["for"] = a.for_
        rule["labels"] = {"severity": a.severity}
        rule["annotations"] = {"summary": text(a.summary), "runbook": text(a.runbook)}
        out.append(rule)
    return out


def plain() -> str:
    doc = {"groups": [{"name": "skiff", "rules": rules(chart=False)}]}
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=10**6)


def template() -> str:
    body = yaml.safe_dump(rules(chart=True), sort_keys=False, width=10**6)
    return TEMPLATE_HEAD + "".join(f"        {ln}\n" for ln in body.splitlines()) + "{{- end }}\n"


HEADER = "# Generated by charts/skiff/alerts/generate.py: edit that, then run it.\n"
TEMPLATE_HEAD = (
    "{{- /* Generated by alerts/generate.py from the same alerts as alerts/skiff.rules.yaml: "
    "edit that, then run it. */}}\n"
    "{{- if .Values.metrics.prometheusRule.enabled }}\n"
    "apiVersion: monitoring.coreos.com/v1\n"
    "kind: PrometheusRule\n"
    "metadata:\n"
    '  name: {{ include "skiff.fullname" . }}\n'
    "  labels:\n"
    '    {{- include "skiff.labels" (dict "ctx" . "component" "alerts") | nindent 4 }}\n'
    "    {{- with .Values.metrics.prometheusRule.labels }}\n"
    "    {{- toYaml . | nindent 4 }}\n"
    "    {{- end }}\n"
    "spec:\n"
    "  groups:\n"
    '    - name: {{ include "skiff.fullname" . }}\n'
    "      rules:\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files differ")
    check = parser.parse_args().check
    stale = []
    for path, text in ((RULES, plain()), (TEMPLATE, template())):
        if not check:
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(path.name)
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}; run python charts/skiff/alerts/generate.py")


if __name__ == "__main__":
    main()
