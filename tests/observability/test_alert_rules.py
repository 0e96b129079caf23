"""The alert rules under `promtool test rules` (Debian's promtool, see install_prometheus.py):
for each alert, input series that make it fire and the labels and summary it must fire with;
series that must not fire; and the generated files match their generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.observability.tools import CHART, binary

RULES = CHART / "alerts" / "skiff.rules.yaml"
W = 'job="skiff-worker"'

# (alert, input series, eval time, expected labels beyond alertname and severity, summary);
# summary None: the alert must not fire then.
CASES = [
    ("SkiffWorkerDown", {f'up{{{W}, instance="w0:9100"}}': "1 1 0x6"}, "3m", {}, None),
    (
        "SkiffWorkerDown",
        {f'up{{{W}, instance="w0:9100"}}': "1 1 0x6"},
        "5m",
        {"job": "skiff-worker", "instance": "w0:9100"},
        "Worker w0:9100 has not answered a scrape for 2 minutes.",
    ),
    (
        "SkiffWorkerFlapping",
        {f'process_start_time_seconds{{{W}, instance="w1:9100"}}': "1 1 2 2 3 3 4 4"},
        "7m",
        {"job": "skiff-worker", "instance": "w1:9100"},
        "Worker w1:9100 restarted 3 times in 30 minutes.",
    ),
    (
        "SkiffQueueGrowingKVSaturated",
        {
            'vllm:num_requests_waiting{model_name="m"}': "0+1x20",
            'vllm:kv_cache_usage_perc{model_name="m"}': "0.95x20",
            'vllm:num_requests_waiting{model_name="n"}': "0+1x20",  # queue grows, KV not full
            'vllm:kv_cache_usage_perc{model_name="n"}': "0.5x20",
        },
        "15m",
        {"model_name": "m"},
        "m: the queue keeps growing while the KV cache is full.",
    ),
    (
        "SkiffTTFTHigh",
        {
            'vllm:time_to_first_token_seconds_bucket{model_name="m", le="0.5"}': "0+1x30",
            'vllm:time_to_first_token_seconds_bucket{model_name="m", le="5"}': "0+10x30",
            'vllm:time_to_first_token_seconds_bucket{model_name="m", le="+Inf"}': "0+10x30",
        },
        "20m",
        {"model_name": "m"},
        "m: time to first token p95 is 4.75 s, over the SLO.",
    ),
    (
        "SkiffErrorRate",
        {
            'skiff_gateway_http_requests_total{status="200"}': "0+90x20",
            'skiff_gateway_http_requests_total{status="503"}': "0+10x20",
        },
        "10m",
        {},
        "10% of gateway responses are 5xx.",
    ),
    (
        "SkiffErrorRate",  # no 5xx series at all: the ratio is 0, not absent
        {'skiff_gateway_http_requests_total{status="200"}': "0+90x20"},
        "10m",
        {},
        None,
    ),
    (
        "SkiffStepTimeRegression",
        {  # 10 ms per step for 6 h, then 50 ms
            'skiff_worker_step_seconds_sum{worker_id="w0"}': "0+1x360 365+5x39",
            'skiff_worker_step_seconds_count{worker_id="w0"}': "0+100x400",
        },
        "390m",
        {"worker_id": "w0"},
        "Worker w0: mean step time is 3.75x its 6-hour mean.",
    ),
    (
        "SkiffNatsDisconnected",
        {'skiff_nats_connected{job="skiff-gateway", instance="g:8000"}': "1 1 0 0 0 0"},
        "5m",
        {"job": "skiff-gateway", "instance": "g:8000"},
        "skiff-gateway g:8000 has been disconnected from NATS for 1 minute.",
    ),
    (
        "SkiffSchedulerRestarted",
        {'skiff_worker_scheduler_epoch_changes_total{worker_id="w0"}': "0 0 0 1 1 1"},
        "5m",
        {},
        "Workers received plans of a new scheduler epoch: a scheduler restarted or a standby "
        "took over.",
    ),
    (
        "SkiffPreemptionStorm",
        {'vllm:num_preemptions_total{model_name="m"}': "0+120x30"},
        "20m",
        {"model_name": "m"},
        "m: 2 preemptions per second.",
    ),
    (
        "SkiffKVDiskTierErrors",
        {
            'skiff:kv_disk_tier_errors_total{worker_id="w0", op="write"}': "0 0 0 1 1 1",
            'skiff:kv_disk_tier_errors_total{worker_id="w1", op="write"}': "0x5",  # none
        },
        "5m",
        {"worker_id": "w0", "op": "write"},
        "Worker w0: KV disk tier write errors.",
    ),
    (
        "SkiffKVDiskTierErrors",  # the tier failed its setup at start: off while the worker runs
        {'skiff:kv_disk_tier_errors_total{worker_id="w0", op="setup"}': "1x20"},
        "20m",
        {"worker_id": "w0", "op": "setup"},
        "Worker w0: KV disk tier setup errors.",
    ),
    (
        "SkiffKVDiskTierErrors",  # read errors more than 10 minutes ago
        {'skiff:kv_disk_tier_errors_total{worker_id="w0", op="read"}': "0 1x20"},
        "20m",
        {},
        None,
    ),
]


def promtool_tests(rules: dict) -> dict:
    by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}
    tests = []
    for alert, series, at, labels, summary in CASES:
        rule = by_name[alert]
        expected = []
        if summary is not None:
            annotations = {"summary": summary, "runbook": rule["annotations"]["runbook"]}
            expected = [
                {
                    "exp_labels": {"severity": rule["labels"]["severity"], **labels},
                    "exp_annotations": annotations,
                }
            ]
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
            }
        )
    return {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}


def test_every_alert_has_a_case_that_fires():
    rules = yaml.safe_load(RULES.read_text())
    names = {r["alert"] for r in rules["groups"][0]["rules"]}
    assert names == {case[0] for case in CASES if case[4] is not None}
    for rule in rules["groups"][0]["rules"]:
        assert rule["annotations"]["runbook"] and rule["labels"]["severity"]


def test_promtool_check_and_test_rules(tmp_path: Path):
    promtool = binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test_file = tmp_path / "skiff.rules.test.yaml"
    test_file.write_text(yaml.safe_dump(promtool_tests(yaml.safe_load(RULES.read_text()))))
    run = subprocess.run(
        [promtool, "test", "rules", str(test_file)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("generator", ["alerts/generate.py", "dashboards/generate.py"])
def test_generated_files_match_their_generator(generator: str):
    """The committed rules, PrometheusRule template and dashboards are what the generators
    write (edit the generator, then run it)."""
    run = subprocess.run(
        [sys.executable, str(CHART / generator), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
