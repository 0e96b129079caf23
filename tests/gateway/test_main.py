"""The gateway process: its configuration and its imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.gateway.fakes import MODEL


def test_gateway_does_not_import_torch():
    code = (
        "import sys, services.gateway.main, services.gateway.app; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_gateway_config_from_env_and_flags(monkeypatch):
    from services.gateway.main import parse_args

    monkeypatch.setenv("SKIFF_PORT", "9001")
    monkeypatch.setenv("SKIFF_API_KEY", "k")
    monkeypatch.setenv("SKIFF_MAX_MODEL_LEN", "512")
    config = parse_args(["--subject-prefix", "a.b", "--gateway-id", "gw-1"])
    assert (config.port, config.api_key, config.max_model_len) == (9001, "k", 512)
    assert (config.subject_prefix, config.gateway_id) == ("a.b", "gw-1")
    assert config.resolved_model_name == MODEL
    with pytest.raises(SystemExit):
        parse_args(["--gateway-id", "bad.id"])


def test_scheduler_shards_from_flag_or_env_reach_the_engine_client(monkeypatch):
    from services.gateway.config import GatewayConfig
    from services.gateway.engine_client import NatsEngineClient
    from services.gateway.main import parse_args

    assert len(NatsEngineClient(parse_args([])).shards) == 1
    monkeypatch.setenv("SKIFF_SCHEDULER_SHARDS", "2")
    assert len(NatsEngineClient(parse_args([])).shards) == 2
    engine = NatsEngineClient(parse_args(["--scheduler-shards", "3", "--subject-prefix", "p"]))
    assert [s.subjects.prefix for s in engine.shards] == ["p.shard0", "p.shard1", "p.shard2"]
    with pytest.raises(ValueError):
        GatewayConfig(scheduler_shards=0)
