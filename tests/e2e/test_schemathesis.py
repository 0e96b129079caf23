"""schemathesis against the live gateway of the real stack: no 5xx, and nothing crashes.

Generated generation requests are capped at a few tokens (a random `max_tokens` up to the
context length would only make the run slow, not more thorough)."""

from __future__ import annotations

import httpx
import hypothesis
import schemathesis

MAX_TOKENS_CAP = 4


def _cap_generation(body) -> None:
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and (body[key] is None or isinstance(body[key], int)):
            body[key] = MAX_TOKENS_CAP if body[key] is None else min(body[key], MAX_TOKENS_CAP)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS_CAP
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2


def test_live_gateway_fuzz_no_server_errors(stack):
    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(
            max_examples=12,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        def check(case):
            _cap_generation(case.body)
            response = case.call(base_url=stack.url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{label} -> {response.status_code}: {response.text[:200]}")  # noqa: B023

        check()
    assert not failures, failures
    assert httpx.get(f"{stack.url}/health").status_code == 200
    stack.check_alive()  # every service process is still running
