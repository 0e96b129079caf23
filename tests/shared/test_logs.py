"""Log formats, the telemetry settings and the OTLP endpoint rule."""

from __future__ import annotations

import io
import json
import logging

import pytest

from shared.config import TelemetryConfig
from shared.logs import JsonFormatter, RequestIdFilter, TextFormatter, request_id_var
from shared.tracing import traces_url


def _emit(formatter: logging.Formatter, message: str, **extra) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    try:
        logger.warning(message, extra=extra or None)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_json_lines_carry_the_request_id_from_the_context_or_the_call():
    token = request_id_var.set("abc")
    try:
        entry = json.loads(_emit(JsonFormatter("gateway"), "hi\nthere", status=200))
    finally:
        request_id_var.reset(token)
    assert entry["message"] == "hi\nthere" and entry["time"].endswith("Z")
    assert (entry["service"], entry["level"], entry["logger"]) == (
        "gateway",
        "WARNING",
        "test.logs",
    )
    assert (entry["request_id"], entry["status"]) == ("abc", 200)
    assert json.loads(_emit(JsonFormatter("worker"), "x", request_id="r-1"))["request_id"] == "r-1"
    assert "request_id" not in json.loads(_emit(JsonFormatter("worker"), "x"))


def test_text_lines_name_the_service_and_request():
    assert (
        _emit(TextFormatter("scheduler"), "done", request_id="r-1")
        .rstrip()
        .endswith("WARNING scheduler test.logs [r-1] done")
    )
    assert _emit(TextFormatter("scheduler"), "up").rstrip().endswith("scheduler test.logs up")


def test_telemetry_settings_are_checked():
    assert TelemetryConfig() == TelemetryConfig(log_format="text", otlp_traces_endpoint="")
    with pytest.raises(ValueError, match="text or json"):
        TelemetryConfig(log_format="xml")
    with pytest.raises(ValueError, match="http"):
        TelemetryConfig(otlp_traces_endpoint="collector:4318")


def test_traces_url_adds_the_otlp_path_only_when_missing():
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
