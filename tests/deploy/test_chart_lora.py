"""The chart's LoRA adapters, rendered by a real helm: lora.* reach the workers' and the
scheduler's SKIFF_* environment and parse to the settings they name, the adapters' volume is
mounted read-only at /adapters in the worker pods only, and the render fails without one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.lora_registry import parse_lora_modules
from services.scheduler.main import build_parser as scheduler_parser
from services.worker.config import RunnerConfig
from services.worker.main import build_parser as worker_parser
from tests.deploy.test_chart_kv_tiers import container, env_of, render_error, volumes
from tests.deploy.test_chart_pd import parsed
from tests.deploy.test_chart_render import KUBERNETES_VERSIONS, find, pod_spec, render, validate_all

PVC = {"persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}
LORA = {
    "enabled": True,
    "maxLoras": 8,
    "maxLoraRank": 32,
    "modules": {"sql": "sql-v2", "chat": "/team/chat"},
    "runtimeLoading": True,
    "volume": PVC,
}


def lora_values(**overrides: Any) -> str:
    return f"lora={json.dumps({**LORA, **overrides})}"


def scheduler_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return env_of(container(docs, "Deployment", "skiff-scheduler"))


def runner_config(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> RunnerConfig:
    """The runner settings `skiff worker` parses from `env`."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            if name.startswith("SKIFF_") and isinstance(value, str):
                m.setenv(name, value)
        parser = worker_parser()
        ns, _ = parser.parse_configs([])
        return parser.config(RunnerConfig, ns, model_dir="/models/m")


def test_lora_values_reach_the_workers_and_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, lora_values())
    runner = runner_config(env_of(container(docs, "StatefulSet", "skiff-worker")), monkeypatch)
    assert (runner.enable_lora, runner.max_loras, runner.max_lora_rank) == (True, 8, 32)
    service = parsed(scheduler_parser, scheduler_env(docs), monkeypatch)[SchedulerServiceConfig]
    assert parse_lora_modules(service.lora_modules) == {
        "chat": "/adapters/team/chat",
        "sql": "/adapters/sql-v2",
    }
    assert service.lora_root == "/adapters"
    worker_pod = pod_spec(find(docs, "StatefulSet", "skiff-worker"))
    (c,) = worker_pod["containers"]
    assert {"name": "lora", "mountPath": "/adapters", "readOnly": True} in c["volumeMounts"]
    assert volumes(worker_pod)["lora"] == {"name": "lora", **PVC}
    scheduler_pod = pod_spec(find(docs, "Deployment", "skiff-scheduler"))
    assert "lora" not in volumes(scheduler_pod)  # it reads no adapter file
    assert validate_all([find(docs, "StatefulSet", "skiff-worker")], KUBERNETES_VERSIONS[-1]) == 1


def test_without_runtime_loading_the_scheduler_has_no_root(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, lora_values(runtimeLoading=False))
    service = parsed(scheduler_parser, scheduler_env(docs), monkeypatch)[SchedulerServiceConfig]
    assert service.lora_root == "" and service.lora_modules


def test_lora_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None)
    assert not any(k.startswith("SKIFF_LORA") for k in scheduler_env(docs))
    env = env_of(container(docs, "StatefulSet", "skiff-worker"))
    assert "SKIFF_ENABLE_LORA" not in env
    assert "lora" not in volumes(pod_spec(find(docs, "StatefulSet", "skiff-worker")))


def test_lora_needs_a_volume_and_valid_names() -> None:
    assert "lora.volume is required" in render_error(lora_values(volume={}))
    assert "'bad name' does not match pattern" in render_error(
        lora_values(modules={"bad name": "x"})
    )
    assert "'x y' does not match pattern" in render_error(lora_values(modules={"a": "x y"}))


def test_each_model_has_adapters_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `models` entry's lora: its own modules and volume over the top-level settings; an
    entry without one serves no adapters (the top-level ones fit the first model only)."""
    own = {"persistentVolumeClaim": {"claimName": "small-adapters", "readOnly": True}}
    entries = [
        {
            "id": "small",
            "model": {"source": "embedded"},
            "lora": {"enabled": True, "maxLoras": 2, "modules": {"chat": "c1"}, "volume": own},
        },
        {"id": "other", "model": {"source": "embedded"}},
    ]
    docs = render(None, lora_values(runtimeLoading=False), f"models={json.dumps(entries)}")
    first = parsed(scheduler_parser, scheduler_env(docs), monkeypatch)[SchedulerServiceConfig]
    assert parse_lora_modules(first.lora_modules) == {
        "chat": "/adapters/team/chat",
        "sql": "/adapters/sql-v2",
    }
    small_env = env_of(container(docs, "Deployment", "skiff-small-scheduler"))
    small = parsed(scheduler_parser, small_env, monkeypatch)[SchedulerServiceConfig]
    assert parse_lora_modules(small.lora_modules) == {"chat": "/adapters/c1"}
    worker = env_of(container(docs, "StatefulSet", "skiff-small-worker"))
    runner = runner_config(worker, monkeypatch)
    assert (runner.enable_lora, runner.max_loras, runner.max_lora_rank) == (True, 2, 32)
    pod = pod_spec(find(docs, "StatefulSet", "skiff-small-worker"))
    assert volumes(pod)["lora"] == {"name": "lora", **own}  # replaced, not merged with PVC's
    assert not any(
        k.startswith("SKIFF_LORA")
        for k in env_of(container(docs, "Deployment", "skiff-other-scheduler"))
    )
    other = pod_spec(find(docs, "StatefulSet", "skiff-other-worker"))
    assert "SKIFF_ENABLE_LORA" not in env_of(other["containers"][0])
    assert "lora" not in volumes(other)
