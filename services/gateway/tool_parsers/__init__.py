"""Parsers of the tool-call formats models write on their own (`tool_choice: "auto"`), by
model family, as vLLM's `--tool-call-parser`: a name maps to a parser class; each instance
parses one choice's output (`services.gateway.tool_calls.OutputParser`).

The default is the first parser whose marker appears in the model's chat template, else
`hermes`."""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.tool_calls import OutputParser
from services.gateway.tool_parsers.hermes import HermesToolParser

DEFAULT_TOOL_PARSER = "hermes"

# name -> (the parser, a text in chat templates of the models that write this format)
TOOL_PARSERS: dict[str, tuple[Callable[[], OutputParser], str]] = {
    "hermes": (HermesToolParser, HermesToolParser.START),
}


def tool_parser(name: str) -> Callable[[], OutputParser]:
    """The parser class named `name`; `ValueError` listing the known ones if none is."""
    try:
        return TOOL_PARSERS[name][0]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})") from None


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser for a model, from its chat template."""
    for name, (_, marker) in TOOL_PARSERS.items():
        if chat_template and marker in chat_template:
            return name
    return DEFAULT_TOOL_PARSER
