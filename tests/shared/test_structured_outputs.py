"""The structured-outputs wire contract: exactly one constraint, the engine's own message for
an invalid spec, validation through `validate_sampling_params`, and an additive wire field."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.sampling_params import SamplingParams, SamplingParamsError, validate_sampling_params
from shared.structured_outputs import StructuredOutputsParams as S
from shared.structured_outputs import check_structured_outputs
from shared.wire import decoder, encode

pytestmark = pytest.mark.unit

VALID = [
    S(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    S(regex=r"[0-9]{3}-[a-z]+"),
    S(choice=["yes", "no", 'quote"d']),
    S(grammar='start: "a" b\nb: "c" | "d"'),  # Lark
    S(grammar='root ::= "a" | "b"'),  # GBNF
    S(json_object=True),
]
INVALID = [
    (S(json='{"type": "objekt"}'), "Invalid JSON schema: .*objekt"),
    (S(json="{"), "Invalid JSON schema: not valid JSON"),
    (S(json="[1]"), "Invalid JSON schema: a JSON schema must be an object"),
    (S(json='{"type": "string", "format": "nope"}'), "Unknown format: nope"),
    (S(regex="[a-"), "(?s)Invalid regex: .*unclosed character class"),
    (S(grammar="start: foo"), 'Invalid grammar: .*unknown name: "foo"'),
    (S(choice=[]), "choice must list at least one string"),
    (S(), "exactly one of .*; none were specified"),
    (S(regex="a", json_object=True), r"multiple \(regex, json_object\)"),
]


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs_pass(spec):
    check_structured_outputs(spec)
    validate_sampling_params(SamplingParams(structured_outputs=spec), 100)


@pytest.mark.parametrize(("spec", "message"), INVALID)
def test_invalid_specs_say_why(spec, message):
    with pytest.raises(ValueError, match=message):
        check_structured_outputs(spec)
    with pytest.raises(SamplingParamsError, match=message) as exc:
        validate_sampling_params(SamplingParams(structured_outputs=spec), 100)
    assert exc.value.param == "structured_outputs"


def test_the_field_is_additive_on_the_wire():
    """Without structured outputs the encoding is unchanged (older peers decode it); with
    them, they survive the codec and `for_choice` (n > 1: each child keeps the spec)."""
    plain = SamplingParams(temperature=0.5)
    assert b"structured_outputs" not in encode(plain)
    spec = SamplingParams(n=2, seed=1, structured_outputs=S(choice=["a", "b"]))
    back = decoder(SamplingParams).decode(encode(spec))
    assert back == spec
    assert back.for_choice(1).structured_outputs == spec.structured_outputs
    assert msgspec.to_builtins(spec.structured_outputs) == {"choice": ["a", "b"]}
