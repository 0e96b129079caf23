"""Tool calls read out of generated text, as it streams.

Every output parser of a chat choice (`OutputParser`) takes text pieces (`feed`) and the end
(`finish`) and gives back `ParsedDelta`s: content text and tool-call deltas in OpenAI's shape (a
call's first delta has its `id` and `name`, the next ones fragments of its `arguments`). A
non-streaming response feeds the whole text at once, so both paths parse alike.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

_WS = " \t\r\n"


def _utf8(text: str) -> bool:
    """Whether `text` encodes (JSON escapes can make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """One entry of a streamed `delta.tool_calls`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            body["id"] = self.id
            body["type"] = "function"
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        body["function"] = function
        return body


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, later: ParsedDelta) -> ParsedDelta:
        self.content += later.content
        self.calls.extend(later.calls)
        return self

    def merged_calls(self) -> list[ToolCallDelta]:
        """Consecutive deltas of one call as one (its header and argument fragments)."""
        merged: list[ToolCallDelta] = []
        for delta in self.calls:
            if merged and merged[-1].index == delta.index and delta.id is None:
                merged[-1].arguments += delta.arguments
            else:
                merged.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
        return merged


class OutputParser(Protocol):
    """Splits a choice's text into content and tool calls."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def num_calls(self) -> int: ...


class ContentParser:
    """No tool calls: everything is content."""

    num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


def parse_all(parser: OutputParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content and the complete tool calls (`message.tool_calls`) of a whole text."""
    parsed = parser.feed(text).extend(parser.finish())
    calls: dict[int, dict[str, Any]] = {}
    for delta in parsed.calls:
        call = calls.setdefault(
            delta.index, {"id": delta.id, "type": "function", "function": {"arguments": ""}}
        )
        if delta.name is not None:
            call["function"] = {"name": delta.name, "arguments": call["function"]["arguments"]}
        call["function"]["arguments"] += delta.arguments
    return parsed.content, [calls[i] for i in sorted(calls)]


# ---- one call as JSON ------------------------------------------------------------------------

_PARTIAL, _NO = "partial", "no"


def _call_head(body: str, argument_keys: tuple[str, ...]) -> tuple[str, str, int]:
    """Match `{"name": "<name>", "<argument key>": ` followed by `{` at the start of `body`:
    ("match", name, where the arguments begin), or (_PARTIAL | _NO, "", 0) when `body` may
    still become one, or cannot."""
    n, i = len(body), 0

    def skip_ws(i: int) -> int:
        while i < n and body[i] in _WS:
            i += 1
        return i

    def literal(i: int, options: tuple[str, ...]) -> int | str:
        for option in options:
            piece = body[i : i + len(option)]
            if piece == option:
                return i + len(option)
            if i + len(piece) == n and option.startswith(piece):
                return _PARTIAL
        return _NO

    name = ""
    keys = tuple(f'"{k}"' for k in argument_keys)
    for step in ("{", '"name"', ":", "string", ",", "keys", ":", "peek"):
        i = skip_ws(i)
        if i == n:
            return _PARTIAL, "", 0
        if step == "peek":
            return ("match", name, i) if body[i] == "{" else (_NO, "", 0)
        if step == "string":
            end = _string_end(body, i)
            if end is None:
                return _NO, "", 0
            if end == n:
                return _PARTIAL, "", 0
            try:
                name = json.loads(body[i:end])
            except json.JSONDecodeError:
                return _NO, "", 0
            if not _utf8(name):
                return _NO, "", 0
            i = end
            continue
        result = literal(i, keys if step == "keys" else (step,))
        if isinstance(result, str):
            return result, "", 0
        i = result
    raise AssertionError("unreachable")


def _string_end(text: str, start: int) -> int | None:
    """Index after the JSON string starting at `start` (len(text) if unterminated), or None if
    none starts there."""
    if text[start] != '"':
        return None
    i, n = start + 1, len(text)
    while i < n:
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return n


class JsonDepth:
    """Nesting depth of JSON text fed piece by piece (brackets inside strings ignored)."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False

    def step(self, char: str) -> int:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        return self.depth


class CallScanner:
    """One tool call `{"name": ..., "arguments": {...}}` as its JSON text streams in.

    With the name first (as models write it), the call's header goes out once the arguments
    begin, and then the arguments as they come, up to the end of their object. Any other shape
    waits for the whole text (`close`), which is then a call or not one."""

    def __init__(self, index: int, argument_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.index = index
        self.body = ""
        self._keys = argument_keys
        self._state = _PARTIAL  # or "match" (streaming the arguments) or _NO (waiting)
        self._args_at = 0  # where the unsent arguments begin in `body`
        self._args = JsonDepth()
        self._args_done = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.body += text
        out: list[ToolCallDelta] = []
        if self._state == _PARTIAL:
            self._state, name, self._args_at = _call_head(self.body, self._keys)
            if self._state == "match":
                out.append(ToolCallDelta(self.index, tool_call_id(), name))
        if self._state == "match" and not self._args_done:
            start = end = self._args_at
            while end < len(self.body):
                end += 1
                if self._args.step(self.body[end - 1]) == 0:
                    self._args_done = True
                    break
            self._args_at = end
            if end > start:
                out.append(ToolCallDelta(self.index, arguments=self.body[start:end]))
        return out

    def close(self) -> tuple[bool, list[ToolCallDelta]]:
        """(whether the text was a call, the deltas not sent yet)."""
        if self._state == "match":
            return True, []
        try:
            call = json.loads(self.body)
        except json.JSONDecodeError:
            return False, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False, []
        arguments: object = next((call[k] for k in self._keys if k in call), {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not (_utf8(call["name"]) and _utf8(arguments)):
            return False, []
        return True, [ToolCallDelta(self.index, tool_call_id(), call["name"], arguments)]
