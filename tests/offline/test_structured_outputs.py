"""Structured outputs through the offline engine on the embedded SmolLM2, sampled at
temperature 0.8: every output follows its JSON schema, regex or choice, beside every other
sampling parameter, and a seeded output is the same when preemption rebuilds its matcher."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.offline import LLM, SamplingParams
from shared.structured_outputs import StructuredOutputsParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["tags", "point"],
        "additionalProperties": False,
    },
]
REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
PROMPT = "Answer in JSON. Describe a person who lives in Paris."


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, kv_cache_gib=0.25)


def params(structure: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=96, structured_outputs=structure, **kw)


def follows(schema: dict):
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    return check


def test_json_regex_and_choice_outputs_are_valid(llm):
    """With top-p/k, penalties, logprobs, seeds and n > 1 (each child its own matcher), next
    to unconstrained requests in the same batches."""
    cases = []
    for schema in SCHEMAS:
        spec = StructuredOutputsParams(json=json.dumps(schema))
        valid = follows(schema)
        cases.append((params(spec, n=3, seed=5), valid))
        cases.append((params(spec, top_p=0.9, top_k=40, presence_penalty=0.5, logprobs=2), valid))
    regex = StructuredOutputsParams(regex=REGEX)
    cases.append(
        (params(regex, n=2, repetition_penalty=1.2), lambda t: bool(re.fullmatch(REGEX, t)))
    )
    choice = StructuredOutputsParams(choice=CHOICES)
    cases.append((params(choice, n=4, min_tokens=3), lambda t: t in CHOICES))
    any_object = StructuredOutputsParams(json_object=True)
    # seeded: any JSON object may also be an unbounded string that runs into max_tokens
    cases.append((params(any_object, seed=11), lambda t: isinstance(json.loads(t), dict)))
    free = SamplingParams(temperature=0.8, max_tokens=24, seed=1, ignore_eos=True)
    outs = llm.generate([PROMPT] * (len(cases) + 1), [p for p, _ in cases] + [free])
    for i, ((p, check), out) in enumerate(zip(cases, outs, strict=False)):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (i, completion.text)
            assert check(completion.text), (i, completion.text)
            if p.logprobs:
                assert len(completion.logprobs) == len(completion.token_ids)
    assert outs[-1].outputs[0].finish_reason == "length"


def test_seeded_output_survives_preemption(smollm2_dir, llm):
    """A KV cache too small for every request preempts some; a resumed request's matcher is
    rebuilt from its tokens and the seeded outputs equal an undisturbed run's."""
    spec = StructuredOutputsParams(json=json.dumps(SCHEMAS[1]))
    prompts = [f"{PROMPT} Person number {i}." for i in range(8)]
    p = params(spec, seed=11)
    reference = [o.outputs[0].text for o in llm.generate(prompts, p)]
    small = LLM(smollm2_dir, num_blocks=12, max_num_seqs=8)
    outs = [o.outputs[0].text for o in small.generate(prompts, p)]
    assert small.scheduler.num_preemptions > 0
    assert outs == reference
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMAS[1])
