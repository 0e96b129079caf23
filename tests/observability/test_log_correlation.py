"""JSON logs follow one request through the gateway, the scheduler and the worker: the gateway
logs under the request id it assigns (X-Request-Id), the scheduler and the worker under the
engine ids, which start with it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e

SERVICE_LOGS = {"gateway": "gateway.log", "scheduler": "scheduler.log", "worker": "sim-workers.log"}


def read_json_logs(log_dir: Path) -> dict[str, list[dict]]:
    """Every line of every service's log, each parsed as one JSON object."""
    return {
        service: [json.loads(line) for line in (log_dir / name).read_text().splitlines() if line]
        for service, name in SERVICE_LOGS.items()
    }


def test_one_request_id_through_every_service(observed_stack):
    client = OpenAI(base_url=f"{observed_stack.url}/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct",
        prompt="Follow me",
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert raw.parse().choices[0].text is not None
    request_id = raw.headers["x-request-id"]
    log_dir = Path(observed_stack.config.log_dir)

    deadline = time.monotonic() + 30
    while True:
        logs = read_json_logs(log_dir)
        mine = {
            service: [e for e in entries if e.get("request_id", "").startswith(request_id)]
            for service, entries in logs.items()
        }
        messages = {s: [e["message"] for e in entries] for s, entries in mine.items()}
        # the gateway logs its access line once the response is sent: it may come last
        done = "request finished: length" in messages["scheduler"]
        done = done and "POST /v1/completions 200" in messages["gateway"]
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    for service, entries in logs.items():  # every line is a complete record
        for entry in entries:
            assert entry["service"] == service
            assert {"time", "level", "logger", "message"} <= entry.keys()
    gateway = mine["gateway"]
    assert all(e["request_id"] == request_id for e in gateway)
    submitted = next(e for e in gateway if e["message"] == "submitted 1 choice(s)")
    (engine_id,) = submitted["engine_req_ids"]
    assert engine_id.startswith(f"{request_id}-")
    assert any(e["message"] == "POST /v1/completions 200" for e in gateway)
    assert {e["request_id"] for e in mine["scheduler"]} == {engine_id}
    assert messages["scheduler"][:1] == ["request added"]
    assert "request finished: length" in messages["scheduler"]
    assert mine["scheduler"][0]["worker_id"] in ("worker-0", "worker-1")
    assert [e["request_id"] for e in mine["worker"]] == [engine_id]
    assert messages["worker"] == ["request added to batch"]
