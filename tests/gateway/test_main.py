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
