"""Flags and SKIFF_* variables derived from the config dataclasses: one definition each."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig, WorkerServiceConfig
from shared.cli_args import ConfigParser, to_argv
from shared.config import SchedulerConfig

CONFIGS = [SchedulerConfig, SchedulerServiceConfig, WorkerServiceConfig, GatewayConfig]


def _parse(cls: type, argv: list[str]) -> object:
    parser = ConfigParser()
    parser.add_config(cls)
    return parser.parse_configs(argv)[1][cls]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_defaults_come_from_the_dataclass(cls, monkeypatch):
    probe = ConfigParser()
    probe.add_config(cls)
    assert probe.env_vars  # one variable per field
    for var in probe.env_vars:
        monkeypatch.delenv(var, raising=False)
    assert _parse(cls, []) == cls()


def test_flag_beats_variable_beats_default(monkeypatch):
    monkeypatch.setenv("SKIFF_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("SKIFF_ENABLE_PREFIX_CACHING", "false")
    assert _parse(SchedulerConfig, []) == SchedulerConfig(
        max_num_seqs=12, enable_prefix_caching=False
    )
    config = _parse(SchedulerConfig, ["--max-num-seqs", "3", "--enable-prefix-caching"])
    assert (config.max_num_seqs, config.enable_prefix_caching) == (3, True)


def test_a_field_is_its_flag_and_variable(monkeypatch):
    monkeypatch.setenv("SKIFF_WORKER_TIMEOUT", "2.5")
    config = _parse(SchedulerServiceConfig, ["--served-model-name", "m"])
    assert (config.worker_timeout, config.served_model_name) == (2.5, "m")
    gateway = _parse(GatewayConfig, ["--max-model-len", "512"])
    assert (gateway.max_model_len, gateway.api_key) == (512, None)


def test_bad_values_are_usage_errors(monkeypatch):
    with pytest.raises(SystemExit):
        _parse(SchedulerConfig, ["--max-num-seqs", "0"])  # the dataclass refuses it
    monkeypatch.setenv("SKIFF_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit):
        _parse(SchedulerConfig, [])


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(max_num_seqs=7, enable_prefix_caching=False),
        SchedulerServiceConfig(nats_url="nats://h:1", worker_timeout=2.0, served_model_name="x"),
        WorkerServiceConfig(worker_id="w-3", heartbeat_interval=0.25),
        GatewayConfig(port=9001, api_key="k", max_model_len=64),
    ],
    ids=lambda c: type(c).__name__,
)
def test_to_argv_reproduces_the_config(config, monkeypatch):
    for var in ("SKIFF_MAX_NUM_SEQS", "SKIFF_LOG_LEVEL", "SKIFF_PORT", "SKIFF_WORKER_ID"):
        monkeypatch.delenv(var, raising=False)
    assert _parse(type(config), to_argv(config)) == config


def test_a_child_inherits_the_variables_for_what_the_parent_left_alone(monkeypatch):
    monkeypatch.setenv("SKIFF_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("SKIFF_MAX_NUM_SEQS", "99")
    config = SchedulerServiceConfig(worker_timeout=2.0)
    assert to_argv(config) == ["--worker-timeout", "2.0"]
    assert _parse(SchedulerServiceConfig, to_argv(config)).log_level == "DEBUG"
    assert _parse(SchedulerConfig, to_argv(SchedulerConfig(max_num_seqs=7))).max_num_seqs == 7


def test_runner_config_needs_its_model_dir():
    parser = ConfigParser()
    parser.add_config(RunnerConfig, build=False)
    args = parser.parse_args(["--kv-cache-gib", "0.5", "--no-cuda-graphs"])
    config = parser.config(RunnerConfig, args, model_dir="/m")
    assert config == RunnerConfig(model_dir="/m", kv_cache_gib=0.5, cuda_graphs=False)
    assert "SKIFF_DTYPE" in parser.env_vars and "SKIFF_MODEL_DIR" not in parser.env_vars
    with pytest.raises(SystemExit):
        parser.config(RunnerConfig, args, model_dir="/m", dtype="int64")


def test_only_some_fields_of_a_config(monkeypatch):
    monkeypatch.setenv("SKIFF_NATS_URL", "nats://elsewhere:1")
    parser = ConfigParser()
    parser.add_config(GatewayConfig, only=("port", "api_key"), build=False)
    args = parser.parse_args(["--port", "9000"])
    assert not hasattr(args, "nats_url") and "SKIFF_NATS_URL" not in parser.env_vars
    assert parser.config(GatewayConfig, args) == GatewayConfig(port=9000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "64"])


def test_serve_passes_its_settings_to_every_process():
    from services.cli import build_serve_parser, stack_config
    from services.launcher import Stack

    parser = build_serve_parser()
    argv = ["--max-model-len", "1024", "--kv-cache-gib", "0.5", "--workers", "2"]
    argv += ["--port", "8123", "--model", "/m", "--served-model-name", "n"]
    args, configs = parser.parse_configs(argv)
    stack_config_ = stack_config(parser, args, configs, args.model)
    stack = Stack(stack_config_)
    spawned: dict[str, list[str]] = {}
    stack._spawn = lambda name, argv: spawned.setdefault(name, argv[3:])  # type: ignore[method-assign]
    stack.start_scheduler()
    stack.start_worker(1)
    stack.start_gateway()
    from services.gateway.main import parse_args as gateway_args
    from services.scheduler.main import parse_args as scheduler_args
    from services.worker.main import build_parser as worker_parser

    service, scheduler = scheduler_args(spawned["scheduler"])
    assert scheduler.max_model_len == 1024 and service.served_model_name == "n"
    parser = worker_parser()
    worker_ns, worker = parser.parse_configs(spawned["worker-1"])
    runner = parser.config(RunnerConfig, worker_ns, model_dir=worker_ns.model)
    assert (runner.model_dir, runner.kv_cache_gib, runner.max_model_len) == ("/m", 0.5, 1024)
    assert worker[WorkerServiceConfig].worker_id == "worker-1"
    assert worker[WorkerServiceConfig].served_model_name == "n"
    assert worker[WorkerServiceConfig].nats_url == stack.nats_url == service.nats_url
    gateway = gateway_args(spawned["gateway"])
    assert (gateway.port, gateway.model_dir, gateway.nats_url) == (8123, "/m", stack.nats_url)
    assert (gateway.served_model_name, gateway.max_model_len) == ("n", None)
    assert dataclasses.replace(stack_config_, workers=2) == stack_config_


def test_serve_runs_a_scheduler_and_a_worker_per_extra_model(capsys):
    from services.cli import build_serve_parser, stack_config
    from services.gateway.main import parse_args as gateway_args
    from services.launcher import Stack
    from services.scheduler.main import parse_args as scheduler_args
    from services.worker.main import build_parser as worker_parser

    parser = build_serve_parser()
    argv = ["--model", "/m", "--served-model-name", "n", "--extra-models", "tiny=/t,big=/b"]
    args, configs = parser.parse_configs(argv)
    stack = Stack(stack_config(parser, args, configs, args.model))
    assert [(m.name, m.subject_prefix) for m in stack.config.models] == [
        ("n", "skiff"),
        ("tiny", "skiff.models.m1"),
        ("big", "skiff.models.m2"),
    ]
    spawned: dict[str, list[str]] = {}
    stack._spawn = lambda name, argv: spawned.setdefault(name, argv[3:])  # type: ignore[method-assign]
    stack.restart("model2-scheduler")
    stack.restart("model2-worker-0")
    stack.start_gateway()
    service, _ = scheduler_args(spawned["model2-scheduler"])
    assert (service.served_model_name, service.subject_prefix) == ("big", "skiff.models.m2")
    assert service.metrics_port == 0
    parser = worker_parser()
    worker_ns, worker = parser.parse_configs(spawned["model2-worker-0"])
    assert worker_ns.model == "/b" and worker_ns.role == "mixed"
    assert worker[WorkerServiceConfig].subject_prefix == "skiff.models.m2"
    assert worker[WorkerServiceConfig].worker_id == "model2-worker-0"
    routes = gateway_args(spawned["gateway"]).models
    assert [(r.name, r.model_dir, r.subject_prefix) for r in routes] == [
        ("n", "/m", "skiff"),
        ("tiny", "/t", "skiff.models.m1"),
        ("big", "/b", "skiff.models.m2"),
    ]
    for bad, error in (
        ([*argv, "--worker-device", "sim"], "extra models need real workers"),
        (["--extra-models", "tiny"], "extra model 'tiny' is not name=path"),
        (["--served-model-name", "n", "--extra-models", "n=/t"], "two models have the same name"),
    ):
        parser = build_serve_parser()
        with pytest.raises(SystemExit):
            args, configs = parser.parse_configs(bad)
            stack_config(parser, args, configs, "/m")
        assert error in capsys.readouterr().err
