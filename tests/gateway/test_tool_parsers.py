"""Tool-call parsers on recorded model outputs, whole and streamed at every split."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import APIError
from services.gateway.schemas import Tool
from services.gateway.tool_calls import OutputParser, ParsedDelta, parse_all
from services.gateway.tool_choice import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolMode,
    tool_schema,
)
from services.gateway.tool_parsers import detect_tool_parser, tool_parser
from services.gateway.tool_parsers.hermes import HermesToolParser

# Recorded Qwen2.5-7B-Instruct outputs (Qwen's function-calling guide), and variations.
QWEN_PARALLEL = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n'
    "</tool_call>"
)
QWEN_SINGLE = (
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
    '"note": "a } and a \\" in a string"}}\n'
    "</tool_call>"
)
TEXT_AROUND = (
    "Let me check the weather for you.\n\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>\n\nI will tell you when it answers."
)
MALFORMED = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call> ok'
# Once the name is out, the call streams: bad arguments reach the client as the model wrote them
# (as OpenAI's may: "the model does not always generate valid JSON").
BAD_ARGUMENTS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
NOT_A_CALL = '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'
ARGUMENTS_FIRST = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
ARGUMENTS_AS_TEXT = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
UNTERMINATED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
LONE_SURROGATE = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'
PLAIN = "No tools needed: 2 < 3 and <tool> is not a tag.\n"

HERMES_CASES = {
    "parallel": (QWEN_PARALLEL, None, ["get_current_temperature", "get_temperature_date"]),
    "single": (QWEN_SINGLE, None, ["get_weather"]),
    "text around": (
        TEXT_AROUND,
        "Let me check the weather for you.I will tell you when it answers.",
        ["get_weather"],
    ),
    "malformed": (MALFORMED, MALFORMED, []),
    "bad arguments": (BAD_ARGUMENTS, None, ["get_weather"]),
    "not a call": (NOT_A_CALL, NOT_A_CALL, []),
    "arguments first": (ARGUMENTS_FIRST, None, ["get_weather"]),
    "arguments as text": (ARGUMENTS_AS_TEXT, None, ["f"]),
    "unterminated": (UNTERMINATED, None, ["get_weather"]),
    "plain": (PLAIN, PLAIN, []),
    "lone surrogate": (LONE_SURROGATE, LONE_SURROGATE, []),
}


def _calls(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _stream(parser: OutputParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces; check the deltas' shape; return what a client assembles."""
    parsed = ParsedDelta()
    for piece in pieces:
        parsed.extend(parser.feed(piece))
    parsed.extend(parser.finish())
    calls: dict[int, list[str]] = {}
    for delta in parsed.calls:
        if delta.index not in calls:  # a call's first delta: id, type and name
            assert delta.id and delta.name and delta.index == len(calls)
            assert delta.payload()["type"] == "function"
            calls[delta.index] = [delta.name, ""]
        else:
            assert delta.id is None and delta.name is None
            assert set(delta.payload()) == {"index", "function"}
        calls[delta.index][1] += delta.arguments
    return parsed.content, [(name, args) for name, args in calls.values()]


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_whole_output(case):
    text, content, names = HERMES_CASES[case]
    got_content, calls = parse_all(HermesToolParser(), text)
    assert (got_content or None) == content
    assert [name for name, _ in _calls(calls)] == names
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        if case == "bad arguments":
            assert call["function"]["arguments"] == '{"city": Paris}'
        else:
            json.loads(call["function"]["arguments"])


def test_hermes_arguments_are_the_models_json():
    _, calls = parse_all(HermesToolParser(), QWEN_PARALLEL)
    assert [json.loads(args) for _, args in _calls(calls)] == [
        {"location": "San Francisco, CA, USA"},
        {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
    ]
    _, calls = parse_all(HermesToolParser(), ARGUMENTS_AS_TEXT)
    assert _calls(calls) == [("f", '{"x": 1}')]


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_streamed_at_every_boundary(case):
    """One character at a time, and cut in two at every position: the client assembles what
    the whole output parses to."""
    text = HERMES_CASES[case][0]
    content, calls = parse_all(HermesToolParser(), text)
    expected = (content, _calls(calls))
    assert _stream(HermesToolParser(), list(text)) == expected
    for cut in range(len(text) + 1):
        assert _stream(HermesToolParser(), [text[:cut], text[cut:]]) == expected, cut


def test_hermes_streams_arguments_before_the_call_ends():
    parser = HermesToolParser()
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    first = parser.feed(head)
    assert first.content == ""
    assert [(d.name, d.arguments) for d in first.calls] == [
        ("get_weather", ""),
        (None, '{"city": "Par'),
    ]
    assert parser.feed('is"}}\n').calls[0].arguments == 'is"}'
    assert parser.feed("</tool_call>").calls == []


def test_hermes_holds_back_a_possible_tag():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.feed("box> done").content == " <toolbox> done"


def test_required_array_streamed():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"zone": "CET", "deep": {"a": [1, "]"]}}}]'
    )
    content, calls = parse_all(RequiredToolCallsParser(), text)
    expected = [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "CET", "deep": {"a": [1, "]"]}}'),
    ]
    assert content == "" and _calls(calls) == expected
    assert _stream(RequiredToolCallsParser(), list(text)) == ("", expected)
    for cut in range(len(text) + 1):
        assert _stream(RequiredToolCallsParser(), [text[:cut], text[cut:]]) == ("", expected)


def test_named_output_is_the_arguments():
    text = '{"city": "Paris", "days": 3}'
    assert _calls(parse_all(NamedToolCallParser("get_weather"), text)[1]) == [("get_weather", text)]
    assert _stream(NamedToolCallParser("get_weather"), list(text)) == (
        "",
        [("get_weather", text)],
    )
    assert _calls(parse_all(NamedToolCallParser("f"), "")[1]) == [("f", "")]


def _tools(*specs: tuple[str, dict | None]) -> list[Tool]:
    return [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in specs
    ]


def test_tool_schemas():
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = _tools(("get_weather", params), ("ping", None))
    assert json.loads(tool_schema(tools, ToolMode("named", "get_weather"), True)) == params
    assert json.loads(tool_schema(tools, ToolMode("named", "ping"), True)) == {
        "type": "object",
        "properties": {},
    }
    required = json.loads(tool_schema(tools, ToolMode("required"), True))
    assert required["type"] == "array" and required["minItems"] == 1
    assert "maxItems" not in required
    branches = required["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["ping"]]
    assert branches[0]["properties"]["parameters"] == params
    assert all(b["required"] == ["name", "parameters"] for b in branches)
    assert json.loads(tool_schema(tools, ToolMode("required"), False))["maxItems"] == 1


def test_required_schema_hoists_defs():
    a = {"$defs": {"City": {"type": "string"}}, "properties": {"c": {"$ref": "#/$defs/City"}}}
    b = {"$defs": {"City": {"type": "string"}}, "properties": {"d": {"$ref": "#/$defs/City"}}}
    schema = json.loads(tool_schema(_tools(("a", a), ("b", b)), ToolMode("required"), True))
    assert schema["$defs"] == {"City": {"type": "string"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {"$defs": {"City": {"type": "integer"}}}
    with pytest.raises(APIError, match="City"):
        tool_schema(_tools(("a", a), ("b", clash)), ToolMode("required"), True)


def test_parser_registry():
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser(None) == "hermes"
    assert tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="known: hermes"):
        tool_parser("nope")
