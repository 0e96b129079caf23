"""Structured outputs on the wire (vLLM's `StructuredOutputsParams`) and their compilation into
an llguidance grammar, shared by the gateway and scheduler (validation) and the worker (its
matchers). Torch-free: llguidance needs no tokenizer to validate.

A spec compiles once per process (LRU-cached by its kind and text), errors included, so a
gateway can call `check_structured_outputs` per request; it takes ~0.1 ms for a fresh schema.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

import msgspec
from llguidance import LLMatcher, grammar_from

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the stub only

# JSON as `json.dumps` writes it: ", " and ": " and no other whitespace, so a model cannot pad
# its output with newlines until max_tokens (vLLM's disable_any_whitespace).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
JSON_OBJECT_SCHEMA = '{"type": "object"}'
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Exactly one constraint: `json` (a JSON schema as JSON text), `regex`, `choice` (one of
    these strings), `grammar` (Lark, or GBNF as llama.cpp writes it) or `json_object` (any
    JSON object)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def spec(self) -> tuple[str, str]:
        """(kind, text): the one constraint set, as a hashable cache key; `ValueError` unless
        exactly one is set."""
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            which = "none" if not kinds else "multiple (" + ", ".join(kinds) + ")"
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object; {which} were specified."
            )
        kind = kinds[0]
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, JSON_OBJECT_SCHEMA
        text = getattr(self, kind)
        assert isinstance(text, str)
        return kind, text


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise `ValueError` with the grammar engine's message for an invalid schema, regex or
    grammar, or a feature it does not support; else return None."""
    compile_grammar(*params.spec())


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar enforcing `params` (for `LLMatcher`); `ValueError` if invalid."""
    return compile_grammar(*params.spec())


def compile_grammar(kind: str, text: str) -> str:
    grammar, error = _compile(kind, text)
    if error:
        raise ValueError(error)
    return grammar


@lru_cache(maxsize=1024)
def _compile(kind: str, text: str) -> tuple[str, str]:
    """(grammar, "") or ("", error message)."""
    label = {
        "json": "JSON schema",
        "json_object": "JSON schema",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }[kind]
    try:
        grammar = _grammar(kind, text)
    except ValueError as exc:
        return "", f"Invalid {label}: {exc}"
    error = LLMatcher.validate_grammar(grammar)
    return (grammar, "") if not error else ("", f"Invalid {label}: {error.strip()}")


def _grammar(kind: str, text: str) -> str:
    if kind in ("json", "json_object"):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "choice":
        choices = json.loads(text)
        if not choices:
            raise ValueError("choice must list at least one string")
        return grammar_from("choice", text)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    return grammar_from("grammar", text)
