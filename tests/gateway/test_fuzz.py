"""The OpenAPI schema is valid and fuzzing it finds no server error."""

from __future__ import annotations

import hypothesis
import schemathesis
from schemathesis.checks import not_a_server_error

from services.gateway.app import create_app
from shared.default_model import default_model_dir
from shared.tokenizer import Tokenizer
from tests.gateway.fakes import MAX_MODEL_LEN, MODEL, FakeEngine

# ---- OpenAPI schema and fuzzing ------------------------------------------------------------


def _fuzz_app(tokenizer: Tokenizer):
    return create_app(FakeEngine(tokenizer), tokenizer, MODEL, MAX_MODEL_LEN)


def test_openapi_schema_is_valid(tokenizer):
    schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzz_app(tokenizer))
    schema.validate()
    paths = schema.raw_schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(paths)


# The schema is built at import (conftest.py prepared the model): lazy fixture loading fails
# under pytest 9.
FUZZ_SCHEMA = schemathesis.openapi.from_asgi(
    "/openapi.json", _fuzz_app(Tokenizer(default_model_dir()))
)


@FUZZ_SCHEMA.parametrize()
@hypothesis.settings(
    max_examples=50,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_schemathesis_fuzz_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error])
