"""One request's spans from the gateway, the scheduler and the worker reach an OTLP collector
in one trace (the client's, from its traceparent header) with the expected parents."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
EXPECTED = {
    "skiff-gateway": {"POST /v1/completions", "tokenize", "generate"},
    "skiff-scheduler": {"queue", "place", "run"},
    "skiff-worker": {"batch"},
}


def test_spans_of_one_request_form_one_trace(observed_stack, otlp_collector):
    response = httpx.post(
        f"{observed_stack.url}/v1/completions",
        headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
        json={"prompt": "Trace me", "max_tokens": 5, "ignore_eos": True},
        timeout=60,
    )
    assert response.status_code == 200, response.text

    deadline = time.monotonic() + 30
    while True:
        spans = [s for s in otlp_collector.snapshot() if s.trace_id == TRACE_ID]
        names = {(s.service, s.name) for s in spans}
        wanted = {(service, n) for service, ns in EXPECTED.items() for n in ns}
        if wanted <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert wanted <= names, f"missing {wanted - names}"
    assert len(spans) == len(wanted), sorted(names)  # one of each: one choice, one worker
    by_name = {s.name: s for s in spans}

    http, generate, run = by_name["POST /v1/completions"], by_name["generate"], by_name["run"]
    assert http.parent_span_id == CLIENT_SPAN_ID
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["http.route"] == "/v1/completions"
    assert by_name["tokenize"].parent_span_id == generate.parent_span_id == http.span_id
    assert generate.attributes["gen_ai.usage.completion_tokens"] == 5
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert [name for name, _ in generate.events] == ["first_token"]
    engine_id = generate.attributes["gen_ai.request.id"]
    assert engine_id.startswith(response.headers["x-request-id"])
    for name in ("queue", "place", "run"):
        assert by_name[name].parent_span_id == generate.span_id
    worker_id = run.attributes["skiff.worker_id"]
    assert by_name["place"].attributes["skiff.worker_id"] == worker_id
    steps = [attrs for name, attrs in run.events if name == "step"]
    assert sum(step["skiff.num_tokens"] for step in steps) >= 5  # the prompt, then 1 per token
    batch = by_name["batch"]
    assert batch.parent_span_id == run.span_id
    assert batch.attributes == {"gen_ai.request.id": engine_id, "skiff.worker_id": worker_id}

    # the worker's step spans are roots of their own traces, linked to the request's batch span
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        linked = [
            s
            for s in otlp_collector.snapshot()
            if s.name == "step" and (TRACE_ID, batch.span_id) in s.links
        ]
        if len(linked) >= len(steps):
            break
        time.sleep(0.2)
    assert len(linked) == len(steps)
    for step in linked:
        assert step.service == "skiff-worker" and step.parent_span_id == ""
        assert step.attributes["skiff.worker_id"] == worker_id
        assert step.attributes["skiff.num_reqs"] >= 1
    assert {s.attributes["skiff.step_id"] for s in linked} == {e["skiff.step_id"] for e in steps}


def test_tracing_off_imports_no_opentelemetry():
    """Off by default: the services' modules load without the OpenTelemetry SDK or exporter
    (FastAPI imports the API package by itself when it is installed)."""
    code = (
        "import sys, services.gateway.app, services.scheduler.service, services.worker.service;"
        "from shared import tracing;"
        "sdk = ('opentelemetry.sdk', 'opentelemetry.exporter');"
        "sys.exit(tracing.tracer is not None or any(m.startswith(sdk) for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
