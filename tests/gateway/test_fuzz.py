"""The OpenAPI schema is valid and fuzzing it finds no server error."""

from __future__ import annotations

import hypothesis
import schemathesis
from schemathesis.checks import not_a_server_error

from services.gateway.app import create_app
from shared.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngine, gateway_config

# ---- OpenAPI schema and fuzzing ------------------------------------------------------------


def _fuzz_app(tokenizer: Tokenizer):
    return create_app(FakeEngine(tokenizer), tokenizer, gateway_config())


def test_openapi_schema_is_valid(tokenizer):
    schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzz_app(tokenizer))
    schema.validate()
    paths = schema.raw_schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(paths)


def test_schemathesis_fuzz_no_server_errors(tokenizer):
    """Every operation of the schema, 50 generated requests each. The schema is loaded here,
    not at import, so collecting the module needs no model (schemathesis's fixture-loaded
    schemas do not run under pytest 9)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzz_app(tokenizer))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 4

    for operation in operations:

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(
            max_examples=50,
            deadline=2000,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        def fuzz(case: schemathesis.Case) -> None:
            hypothesis.note(f"operation: {case.operation.label}")
            case.call_and_validate(checks=[not_a_server_error])

        fuzz()
