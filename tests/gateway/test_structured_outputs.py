"""Structured outputs and tools in the API, against a scripted engine: what reaches the engine
(`SamplingParams.structured_outputs`), the 400s, and tool calls in responses and streams."""

from __future__ import annotations

import json

import pytest

from shared.structured_outputs import StructuredOutputsParams
from shared.tokenizer import Tokenizer
from tests.gateway.fakes import CHAT, MSG, C, FakeEngine, make_client, sse_events

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


async def _post(engine: FakeEngine, tokenizer: Tokenizer, path: str, body: dict, **kwargs):
    """POST `body` as JSON text (ASCII: a lone surrogate travels as its escape)."""
    headers = {"content-type": "application/json"}
    async with make_client(engine, tokenizer, **kwargs) as client:
        return await client.post(path, content=json.dumps(body), headers=headers)


def _sent(engine: FakeEngine) -> StructuredOutputsParams | None:
    return engine.submitted[-1].sampling_params.structured_outputs


# ---- what reaches the engine ------------------------------------------------------------------

MAPPINGS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": SCHEMA},
            }
        },
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    (
        {"structured_outputs": {"json": '{"type": "integer"}'}},
        StructuredOutputsParams(json='{"type": "integer"}'),
    ),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputsParams(regex="[0-9]{3}")),
    (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        StructuredOutputsParams(choice=["yes", "no"]),
    ),
    (
        {"structured_outputs": {"grammar": 'start: "a"+'}},
        StructuredOutputsParams(grammar='start: "a"+'),
    ),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    (
        {"guided_choice": ["x"], "guided_decoding_backend": "xgrammar"},
        StructuredOutputsParams(choice=["x"]),
    ),
    ({"guided_grammar": 'start: "b"'}, StructuredOutputsParams(grammar='start: "b"')),
]


@pytest.mark.anyio
@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize(("fields", "expected"), MAPPINGS)
async def test_structure_reaches_the_engine(engine, tokenizer, path, fields, expected):
    body = {"prompt": "hi"} if path == C else {"messages": MSG}
    r = await _post(engine, tokenizer, path, {**body, **fields, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert _sent(engine) == expected


# ---- refused ---------------------------------------------------------------------------------

REFUSALS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "needs json_schema.schema",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    (
        {"structured_outputs": {"json": {"type": "object", "properties": 3}}},
        "structured_outputs",
        "Invalid JSON schema",
    ),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "Invalid JSON schema"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "Invalid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "Invalid regex"),
    ({"guided_regex": "a{2,1}"}, "guided_regex", "Invalid regex"),
    (
        {"structured_outputs": {"grammar": "start: missing_rule"}},
        "structured_outputs",
        "Invalid grammar",
    ),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "not supported"),
    (
        {"structured_outputs": {"regex": "a", "disable_fallback": True}},
        "structured_outputs.disable_fallback",
        "Extra inputs",
    ),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "magic"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_regex, guided_choice"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "one structured output only",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize(("fields", "param", "message"), REFUSALS)
async def test_bad_structure_is_a_400(engine, tokenizer, path, fields, param, message):
    body = {"prompt": "hi"} if path == C else {"messages": MSG}
    r = await _post(engine, tokenizer, path, {**body, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert engine.submitted == []


# ---- tools -----------------------------------------------------------------------------------

HERMES_OUTPUT = (
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _chat(**fields) -> dict:
    return {"messages": MSG, "tools": [WEATHER, TIME], **fields}


def _assembled(chunks: list[dict]) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["type"] == "function" and call["function"]["name"]
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.anyio
async def test_named_tool_is_enforced_and_returned_as_a_call(tokenizer):
    engine = FakeEngine(tokenizer, text='{"city": "Paris"}')
    r = await _post(engine, tokenizer, CHAT, _chat(tool_choice=NAMED))
    assert r.status_code == 200, r.text
    assert _sent(engine) == StructuredOutputsParams(json=json.dumps(SCHEMA))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    r = await _post(engine, tokenizer, CHAT, _chat(tool_choice=NAMED, stream=True))
    content, calls, finish = _assembled(sse_events(r.text))
    assert (content, calls, finish) == ("", [("get_weather", '{"city": "Paris"}')], "tool_calls")


@pytest.mark.anyio
async def test_required_tool_calls(tokenizer):
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    engine = FakeEngine(tokenizer, text=text)
    r = await _post(engine, tokenizer, CHAT, _chat(tool_choice="required"))
    assert r.status_code == 200, r.text
    schema = json.loads(_sent(engine).json)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    message = r.json()["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    r = await _post(
        engine, tokenizer, CHAT, _chat(tool_choice="required", parallel_tool_calls=False)
    )
    assert json.loads(_sent(engine).json)["maxItems"] == 1
    r = await _post(engine, tokenizer, CHAT, _chat(tool_choice="required", stream=True))
    _, calls, finish = _assembled(sse_events(r.text))
    assert calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert finish == "tool_calls"


@pytest.mark.anyio
@pytest.mark.parametrize("tool_choice", [None, "auto"])
async def test_auto_parses_hermes_calls(tokenizer, tool_choice):
    engine = FakeEngine(tokenizer, text=HERMES_OUTPUT)
    body = _chat() if tool_choice is None else _chat(tool_choice=tool_choice)
    r = await _post(engine, tokenizer, CHAT, body)
    assert r.status_code == 200, r.text
    assert _sent(engine) is None
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    r = await _post(engine, tokenizer, CHAT, {**body, "stream": True, "n": 2})
    chunks = sse_events(r.text)
    for i in range(2):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        assert _assembled(mine) == (
            "Checking.",
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
            "tool_calls",
        )


@pytest.mark.anyio
async def test_tool_choice_none_leaves_text_alone(tokenizer):
    engine = FakeEngine(tokenizer, text=HERMES_OUTPUT)
    r = await _post(engine, tokenizer, CHAT, _chat(tool_choice="none"))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == HERMES_OUTPUT and choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


@pytest.mark.anyio
async def test_auto_with_a_structure(tokenizer):
    """`auto` allows a structure of the request's own (the model's calls still parse)."""
    engine = FakeEngine(tokenizer, text=HERMES_OUTPUT)
    r = await _post(engine, tokenizer, CHAT, _chat(structured_outputs={"regex": "(.|\n)*"}))
    assert r.status_code == 200, r.text
    assert _sent(engine) == StructuredOutputsParams(regex="(.|\n)*")
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 2


LONE_SURROGATE = {"type": "object", "properties": {"\ud800": {"type": "string"}}}
TOOL_REFUSALS = [
    (
        {
            "messages": MSG,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": LONE_SURROGATE}}
            ],
        },
        "tools.0.function.parameters",
        "lone surrogate",
    ),
    (
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 3}}}],
            "tool_choice": "required",
        },
        "tools",
        "is not an object",
    ),
    ({"messages": MSG, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"messages": MSG, "tool_choice": NAMED}, "tool_choice", "`tools` must be set"),
    (
        _chat(tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
        "'nope' has not been passed",
    ),
    (_chat(tool_choice="sometimes"), "tool_choice", "none"),
    (
        _chat(tool_choice="required", response_format={"type": "json_object"}),
        "tool_choice",
        "response_format, tool_choice",
    ),
    (
        {
            "messages": MSG,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
            ],
            "tool_choice": "required",
        },
        "tool_choice",
        "Invalid JSON schema",
    ),
    ({"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    (
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": ""}}]},
        "tools.0.function.name",
        "at least 1",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("body", "param", "message"), TOOL_REFUSALS)
async def test_bad_tools_are_a_400(engine, tokenizer, body, param, message):
    r = await _post(engine, tokenizer, CHAT, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


@pytest.mark.anyio
async def test_tools_and_past_calls_reach_the_chat_template(engine, smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)  # its own: the chat template is replaced
    tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}{{ c.function.arguments.city }}{% endfor %}{% endif %}"
        "{% if m.tool_call_id is defined %}{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    r = await _post(engine, tokenizer, CHAT, {"messages": messages, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert (
        prompt == "[get_weather][get_time]user:weather?;assistant:get_weatherOslo;tool:sunnycall_1;"
    )


@pytest.mark.anyio
async def test_tokenize_chat_with_tools(engine, smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)  # its own: the chat template is replaced
    tokenizer.chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}"
    body = {"messages": MSG, "tools": [WEATHER, TIME], "return_token_strs": True}
    r = await _post(engine, tokenizer, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert "".join(r.json()["token_strs"]) == "get_weather;get_time;"
