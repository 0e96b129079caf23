"""Structured outputs and tool calls through the real stack (SmolLM2 on a CPU worker) with the
official `openai` client: sampled at temperature 0.8, every output follows its structure."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
TEMPERATURE = 0.8
MAX_TOKENS = 256  # far more than any of these structures needs: every output must end
CONCURRENCY = 24  # requests in flight: the scheduler batches them

# ---- schemas -----------------------------------------------------------------------------------

WORD = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 9}
POINT = {
    "type": "object",
    "properties": {"x": SMALL_INT, "y": SMALL_INT},
    "required": ["x", "y"],
    "additionalProperties": False,
}
FIELDS: dict[str, dict[str, Any]] = {
    "name": WORD,
    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
    "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "delta": {"type": "integer", "exclusiveMinimum": -50, "exclusiveMaximum": 50},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "price": {"type": "number", "minimum": 1, "maximum": 999},
    "flag": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "level": {"type": "string", "enum": ["low", "mid", "high"]},
    "version": {"const": "v1"},
    "nickname": {"type": ["string", "null"], "maxLength": 6},
    "either": {"anyOf": [SMALL_INT, {"type": "string", "maxLength": 4}]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "ids": {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 3},
    "pair": {"type": "array", "items": WORD, "minItems": 2, "maxItems": 2},
    "point": POINT,
    "path": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 2},
    "grid": {
        "type": "array",
        "items": {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 2},
        "minItems": 1,
        "maxItems": 2,
    },
    "address": {
        "type": "object",
        "properties": {
            "city": WORD,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": POINT,
        },
        "required": ["city", "zip"],
        "additionalProperties": False,
    },
}


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(sorted(FIELDS), rng.randint(1, 4))
    properties = {n: FIELDS[n] for n in names}
    if depth == 0 and rng.random() < 0.3:
        properties["child"] = _object(rng, depth + 1)
    required = [n for n in properties if rng.random() < 0.7]
    # Closed (as OpenAI's strict mode wants): an open object may add keys and texts of any length.
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def json_schemas(count: int = 60) -> list[dict[str, Any]]:
    """Varied schemas: objects of 1-4 fields (some nested, some optional), plus arrays and enums
    at the top."""
    rng = random.Random(13)
    schemas: list[dict[str, Any]] = [
        {"type": "array", "items": POINT, "minItems": 1, "maxItems": 3},
        {"type": "array", "items": FIELDS["level"], "minItems": 2, "maxItems": 3},
        {"enum": ["yes", "no", "maybe"]},
        FIELDS["address"],
    ]
    while len(schemas) < count:
        schemas.append(_object(rng))
    return schemas


def _run_all(fn, items: list) -> list:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(fn, items))


# ---- JSON schemas, regexes, choices, grammars ---------------------------------------------


def test_sampled_json_always_follows_its_schema(openai_client: OpenAI):
    """60 schemas, each asked for in a different way (response_format json_schema, vLLM's
    structured_outputs, guided_json), streamed or not: 100% parse and validate."""
    schemas = json_schemas()
    assert len(schemas) >= 50

    def generate(job: tuple[int, dict]) -> tuple[str, str | None]:
        i, schema = job
        messages = [{"role": "user", "content": "Describe something as JSON."}]
        common: dict[str, Any] = {
            "model": MODEL,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "seed": i,
        }
        if i % 3 == 0:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            r = openai_client.chat.completions.create(
                messages=messages, response_format=fmt, **common
            )
            return r.choices[0].message.content or "", r.choices[0].finish_reason
        if i % 3 == 1:
            r = openai_client.completions.create(
                prompt="JSON:", extra_body={"structured_outputs": {"json": schema}}, **common
            )
            return r.choices[0].text, r.choices[0].finish_reason
        stream = openai_client.chat.completions.create(
            messages=messages, extra_body={"guided_json": schema}, stream=True, **common
        )
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results = _run_all(generate, list(enumerate(schemas)))
    for schema, (text, finish) in zip(schemas, results, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(openai_client: OpenAI):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A user as JSON."}],
        response_format={"type": "json_object"},
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        n=3,
        seed=1,
    )
    for choice in r.choices:
        if choice.finish_reason == "stop":  # an open object may run to max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"#[0-9a-f]{6}",
]
CHOICES = [["Paris", "London", "Berlin"], ["positive", "negative", "neutral"], ["A", "B"]]


def test_regex_and_choice_outputs_always_match(openai_client: OpenAI):
    jobs: list[tuple[str, Any, int]] = [
        (kind, value, seed)
        for kind, values in (("regex", REGEXES), ("choice", CHOICES))
        for value in values
        for seed in range(3)
    ]

    def generate(job: tuple[str, Any, int]) -> list[str]:
        kind, value, seed = job
        common = {"model": MODEL, "temperature": TEMPERATURE, "max_tokens": 64, "seed": seed}
        if seed == 0:  # the older guided_* names
            r = openai_client.completions.create(
                prompt="Answer:", extra_body={f"guided_{kind}": value}, n=2, **common
            )
            return [c.text for c in r.choices]
        r = openai_client.chat.completions.create(
            messages=[{"role": "user", "content": "Give me an answer."}],
            extra_body={"structured_outputs": {kind: value}},
            n=2,
            **common,
        )
        return [c.message.content or "" for c in r.choices]

    for (kind, value, _), texts in zip(jobs, _run_all(generate, jobs), strict=True):
        for text in texts:
            if kind == "regex":
                assert re.fullmatch(value, text), (value, text)
            else:
                assert text in value


def test_grammar_output_always_parses(openai_client: OpenAI):
    grammar = 'start: word ("," word)*\nword: /[a-z]{1,5}/'
    r = openai_client.completions.create(
        model=MODEL,
        prompt="Some fruits:",
        extra_body={"structured_outputs": {"grammar": grammar}},
        temperature=TEMPERATURE,
        max_tokens=64,
        n=4,
        seed=3,
    )
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert re.fullmatch(r"[a-z]{1,5}(,[a-z]{1,5})*", choice.text), choice.text
        else:  # a list may go on to max_tokens; what there is still follows the grammar
            assert re.fullmatch(r"[a-z]{1,5}(,[a-z]{1,5})*,?[a-z]{0,5}", choice.text)


# ---- tools ------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


def _stream_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) per call, and the finish reason of a streamed choice 0."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(name, args) for name, args in calls.values()], finish


def test_named_tool_is_always_called_with_valid_arguments(openai_client: OpenAI):
    named = {"type": "function", "function": {"name": "get_weather"}}

    def call(seed: int) -> list[tuple[str, str]]:
        common = {
            "model": MODEL,
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": named,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "seed": seed,
        }
        if seed % 2:
            content, calls, finish = _stream_calls(
                openai_client.chat.completions.create(stream=True, **common)
            )
            assert content == "" and finish == "tool_calls"
            return calls
        r = openai_client.chat.completions.create(**common)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    for calls in _run_all(call, list(range(12))):
        [(name, arguments)] = calls
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_calls_are_valid_calls_of_listed_tools(openai_client: OpenAI):
    def call(seed: int) -> list[tuple[str, str]]:
        common = {
            "model": MODEL,
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "seed": seed,
        }
        if seed % 2:
            _, calls, finish = _stream_calls(
                openai_client.chat.completions.create(stream=True, **common)
            )
            assert finish == "tool_calls"
            return calls
        choice = openai_client.chat.completions.create(**common).choices[0]
        assert choice.finish_reason == "tool_calls"
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    for calls in _run_all(call, list(range(8))):
        assert calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_tool_calls_parsed_from_a_stream(openai_client: OpenAI):
    """`auto` parses the model's own Hermes calls. SmolLM2 was not trained to write them, so a
    regex of the request makes it write two (`auto` leaves the request's own structure in
    force); the gateway's Hermes parser turns the streamed text into tool-call deltas."""
    city = (
        r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}'
    )
    zone = r'\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}'
    regex = rf"Let me check\.\n<tool_call>\n{city}\n</tool_call>\n<tool_call>\n{zone}\n</tool_call>"
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"structured_outputs": {"regex": regex}},
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        stream=True,
        seed=5,
    )
    content, calls, finish = _stream_calls(stream)
    assert content == "Let me check." and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_tool_call_the_model_writes_itself(openai_client: OpenAI):
    """Without any structure: asked to, SmolLM2 (greedy) writes a Hermes call on its own, and
    the stream carries it as tool-call deltas after the text before it."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": f"To call a tool, reply with exactly: {call}"},
            {"role": "user", "content": f"Repeat exactly this text: {call}"},
        ],
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    content, calls, finish = _stream_calls(stream)
    assert calls == [("get_weather", '{"city": "Paris"}')] and finish == "tool_calls"
    assert "<tool_call>" not in content


# ---- refused ----------------------------------------------------------------------------------

BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "Invalid JSON schema",
    ),
    (
        {"extra_body": {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}},
        "uniqueItems",
    ),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "Invalid regex"),
    ({"extra_body": {"guided_grammar": "start: missing"}}, "Invalid grammar"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "one structured output only"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_structures_are_400_and_the_stack_stays_healthy(openai_client, stack, fields, message):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    assert message in error.value.message
    assert httpx.get(f"{stack.url}/health").status_code == 200
    stack.check_alive()
    r = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, extra_body={"guided_choice": ["ok"]}
    )
    assert r.choices[0].message.content == "ok"
