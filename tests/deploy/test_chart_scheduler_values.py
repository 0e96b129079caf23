"""The chart's scheduling settings of `skiff scheduler`, rendered by a real helm: the values
reach the scheduler's SKIFF_* environment and parse to the settings they name, the defaults are
the scheduler's own, and every setting the scheduler reads is a chart value or left out for a
stated reason."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import build_parser
from shared.config import SchedulerConfig
from tests.deploy.test_chart_render import find, pod_spec, render
from tests.deploy.test_deploy import VALUES, env_vars_read_by, merged, validator

# values under scheduler: -> the config field each one sets
CHART_SETTINGS = {
    "schedulingPolicy": (SchedulerConfig, "scheduling_policy"),
    "longPrefill.tokenThreshold": (SchedulerConfig, "long_prefill_token_threshold"),
    "longPrefill.stepTimeSeconds": (SchedulerConfig, "long_prefill_step_time"),
    "longPrefill.share": (SchedulerConfig, "long_prefill_share"),
    "maxRequestFailures": (SchedulerServiceConfig, "max_request_failures"),
}
CUSTOM = (
    'scheduler={"schedulingPolicy": "priority", "maxRequestFailures": 4, "longPrefill": '
    '{"tokenThreshold": 1024, "stepTimeSeconds": 0.25, "share": 0.75}}'
)
# SKIFF_* variables of `skiff scheduler` the chart does not set, and why.
NOT_IN_CHART = {
    "SKIFF_ENABLE_PREFIX_CACHING": "scheduler.prefixCaching, as --no-enable-prefix-caching",
    "SKIFF_ASYNC_SCHEDULING": "always on in a deployment (two plans in flight per worker)",
    "SKIFF_HEARTBEAT_INTERVAL": "a protocol timing, kept at the services' default",
    "SKIFF_PREFIX_SUMMARY_MAX_BYTES": "a protocol size, kept at the services' default",
    "SKIFF_GATEWAY_TIMEOUT": "a protocol timing, kept at the services' default",
    "SKIFF_STEP_TIMEOUT": "a protocol timing, kept at the services' default",
    "SKIFF_STEP_TIMEOUT_PER_TOKEN": "a protocol timing, kept at the services' default",
    "SKIFF_LEADER_ELECTION_LOCK_DIR": "tests and development only (Leases as files)",
    "SKIFF_NATS_TLS_CERT": "the chart's NATS TLS verifies the server; clients use passwords",
    "SKIFF_NATS_TLS_KEY": "the chart's NATS TLS verifies the server; clients use passwords",
}


def scheduler_env(*overrides: str) -> dict[str, object]:
    (container,) = pod_spec(find(render(None, *overrides), "Deployment", "skiff-scheduler"))[
        "containers"
    ]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def parsed_settings(env: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The value of each CHART_SETTINGS field once `skiff scheduler` reads `env`."""
    for name, value in env.items():
        if name.startswith("SKIFF_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    _, configs = build_parser().parse_configs([])
    return {key: getattr(configs[cls], field) for key, (cls, field) in CHART_SETTINGS.items()}


def test_the_values_reach_the_scheduler(monkeypatch):
    env = scheduler_env(CUSTOM)
    assert env["SKIFF_SCHEDULING_POLICY"] == "priority"
    assert env["SKIFF_LONG_PREFILL_TOKEN_THRESHOLD"] == "1024"
    assert env["SKIFF_LONG_PREFILL_STEP_TIME"] == "0.25"
    assert env["SKIFF_LONG_PREFILL_SHARE"] == "0.75"
    assert env["SKIFF_MAX_REQUEST_FAILURES"] == "4"
    assert parsed_settings(env, monkeypatch) == {
        "schedulingPolicy": "priority",
        "longPrefill.tokenThreshold": 1024,
        "longPrefill.stepTimeSeconds": 0.25,
        "longPrefill.share": 0.75,
        "maxRequestFailures": 4,
    }


def test_the_default_values_are_the_schedulers_defaults(monkeypatch):
    defaults = {
        key: next(f.default for f in dataclasses.fields(cls) if f.name == field)
        for key, (cls, field) in CHART_SETTINGS.items()
    }
    assert parsed_settings(scheduler_env(), monkeypatch) == defaults


def test_every_scheduler_setting_is_a_chart_value_or_left_out_on_purpose():
    read = env_vars_read_by("scheduler")
    elected = scheduler_env('scheduler={"replicas": 2}')
    optional = scheduler_env(
        'nats={"tls": {"enabled": true, "secretName": "nats-tls"}}',
        'otlpTracesEndpoint="http://otel-collector:4318"',
        'lora={"enabled": true, "runtimeLoading": true, "volume": {"emptyDir": {}}}',
    )
    callout = scheduler_env(  # a service-account token instead of a password
        'nats={"authCallout": {"enabled": true, "signingKeySecret": "k"}}',
        *(
            f'{role}={{"serviceAccount": {{"create": true}}}}'
            for role in ("gateway", "scheduler", "worker")
        ),
    )
    set_by_chart = set(elected) | set(optional) | set(callout)
    assert not set(NOT_IN_CHART) & set_by_chart, "set by the chart: drop it from NOT_IN_CHART"
    assert set(NOT_IN_CHART) <= read, "not a scheduler setting: drop it from NOT_IN_CHART"
    missing = read - set_by_chart - set(NOT_IN_CHART)
    assert not missing, f"`skiff scheduler` settings the chart cannot set: {sorted(missing)}"


@pytest.mark.parametrize(
    "scheduler",
    [
        {"schedulingPolicy": "lifo"},
        {"longPrefill": {"tokenThreshold": -1, "stepTimeSeconds": 0.5, "share": 0.5}},
        {"longPrefill": {"tokenThreshold": 0, "stepTimeSeconds": -0.1, "share": 0.5}},
        {"longPrefill": {"tokenThreshold": 0, "stepTimeSeconds": 0.5, "share": 0}},
        {"longPrefill": {"tokenThreshold": 0, "stepTimeSeconds": 0.5, "share": 1.5}},
        {"longPrefill": {"tokenThreshold": 0, "stepTimeSeconds": 0.5, "share": 0.5, "x": 1}},
        {"maxRequestFailures": 0},
    ],
)
def test_the_schema_refuses_settings_the_scheduler_refuses(scheduler):
    assert list(validator().iter_errors(merged(VALUES, {"scheduler": scheduler})))
