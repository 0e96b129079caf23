"""`tool_choice` of a chat request: which calls are allowed, the JSON schema that enforces a
named function or `"required"` (as vLLM builds them), and the parsers of such outputs.

- `"none"`: the output is content (the tools are still shown to the model by its template);
- `"auto"`: the model's own tool-call format is parsed (`services.gateway.tool_parsers`);
- a named function: the output is that function's arguments (its `parameters` schema);
- `"required"`: the output is a JSON array of one or more `{"name", "parameters"}` calls of
  the listed tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from services.gateway.tool_calls import (
    CallScanner,
    ContentParser,
    JsonDepth,
    OutputParser,
    ParsedDelta,
    ToolCallDelta,
    tool_call_id,
)

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "none", "auto", "named" or "required"
    name: str | None = None  # the named function

    @property
    def forced(self) -> bool:
        """Calls enforced by the grammar."""
        return self.kind in ("named", "required")


def tool_mode(body: ChatCompletionRequest) -> ToolMode:
    """The request's `tool_choice` (OpenAI's default: "auto" with tools, else "none")."""
    choice = body.tool_choice
    if choice is None:
        return ToolMode("auto" if body.tools else "none")
    if choice == "none":
        return ToolMode("none")
    if not body.tools:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in body.tools}:
            raise APIError(400, f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        return ToolMode("named", name)
    return ToolMode(choice)


def tool_schema(tools: list[Tool], mode: ToolMode, parallel_tool_calls: bool) -> str:
    """The JSON schema (as JSON text) of the output a forced `mode` allows."""
    if mode.kind == "named":
        tool = next(t for t in tools if t.function.name == mode.name)
        return json.dumps(tool.function.parameters or _EMPTY_PARAMETERS)
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise APIError(400, f"`$defs` of tool {tool.function.name!r} is not an object", "tools")
        for key, value in tool_defs.items():
            if defs.setdefault(key, value) != value:
                raise APIError(
                    400,
                    f"tools define `$defs/{key}` differently; with tool_choice 'required' "
                    "their definitions must agree",
                    "tools",
                )
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema)


class NamedToolCallParser:
    """The whole output is the arguments of the named function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.num_calls:
            return ParsedDelta(calls=[ToolCallDelta(0, arguments=text)])
        return ParsedDelta(calls=[self._header(text)])

    def finish(self) -> ParsedDelta:
        return ParsedDelta() if self.num_calls else ParsedDelta(calls=[self._header("")])

    def _header(self, arguments: str) -> ToolCallDelta:
        self.num_calls = 1
        return ToolCallDelta(0, tool_call_id(), self.name, arguments)


class RequiredToolCallsParser:
    """The output is a JSON array of `{"name", "parameters"}`; each element is passed on as a
    call while it streams."""

    def __init__(self) -> None:
        self._depth = JsonDepth()
        self._call: CallScanner | None = None
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        start = 0  # where the current element's unsent text begins
        for i, char in enumerate(text):
            before = self._depth.depth
            after = self._depth.step(char)
            if before == 1 and after == 2:
                self._call = CallScanner(self.num_calls, ("parameters",))
                start = i
            elif before == 2 and after == 1 and self._call is not None:
                out.calls.extend(self._call.feed(text[start : i + 1]))
                self._close(out)
        if self._call is not None:
            out.calls.extend(self._call.feed(text[start:]))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._call is not None:
            self._close(out)
        return out

    def _close(self, out: ParsedDelta) -> None:
        assert self._call is not None
        is_call, deltas = self._call.close()
        out.calls.extend(deltas)
        self.num_calls += is_call
        self._call = None


def output_parser(mode: ToolMode, auto: Callable[[], OutputParser]) -> OutputParser:
    """The parser of one choice's output under `mode` (`auto`: the model family's parser)."""
    if mode.kind == "named":
        assert mode.name is not None
        return NamedToolCallParser(mode.name)
    if mode.kind == "required":
        return RequiredToolCallsParser()
    if mode.kind == "auto":
        return auto()
    return ContentParser()
