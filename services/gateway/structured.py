"""The one structure a request asks for, as the wire's `StructuredOutputsParams`.

A request may ask in one of these ways (more than one is a 400): OpenAI's `response_format`
(`json_object`, `json_schema`; `text` asks for nothing), vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`), its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, or a chat's forced `tool_choice` (a named function or
`"required"`). `StructureChecker` compiles it with the engine's grammar compiler in a thread
(bounded in time and concurrency), so an invalid schema, regex or grammar is a 400 with the
engine's message before anything is submitted.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError
from services.gateway.schemas import (
    ResponseFormat,
    StructuredOutputsFields,
    StructuredOutputsRequest,
)
from shared.structured_outputs import StructuredOutputsParams, check_structured_outputs

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class Structure:
    param: str  # the API field that asked for it (errors name it)
    params: StructuredOutputsParams


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format of type json_schema needs json_schema.schema",
            "response_format",
        )
    return StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_))


def _from_structured_outputs(req: StructuredOutputsRequest) -> StructuredOutputsParams:
    if req.structural_tag is not None:
        raise APIError(
            400, "structured_outputs.structural_tag is not supported", "structured_outputs"
        )
    return StructuredOutputsParams(
        json=None if req.json_ is None else _schema_text(req.json_),
        regex=req.regex,
        choice=req.choice,
        grammar=req.grammar,
        json_object=bool(req.json_object),
    )


def _from_guided(name: str, value: Any) -> StructuredOutputsParams:
    if name == "guided_json":
        return StructuredOutputsParams(json=_schema_text(value))
    return StructuredOutputsParams(**{name.removeprefix("guided_"): value})


def requested_structure(body: StructuredOutputsFields) -> Structure | None:
    """The structure the request's own fields ask for, if any (400 if several)."""
    if body.guided_whitespace_pattern is not None:
        raise APIError(
            400, "guided_whitespace_pattern is not supported", "guided_whitespace_pattern"
        )
    found: list[Structure] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        found.append(Structure("response_format", _from_response_format(fmt)))
    if body.structured_outputs is not None:
        params = _from_structured_outputs(body.structured_outputs)
        found.append(Structure("structured_outputs", params))
    for name in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append(Structure(name, _from_guided(name, value)))
    return only_one(found)


def only_one(found: list[Structure]) -> Structure | None:
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise APIError(
            400,
            f"a request may ask for one structured output only, got several: {names}",
            found[1].param,
        )
    return found[0] if found else None


class StructureChecker:
    """Compiles structures off the event loop: at most `concurrency` at once, each within
    `timeout` seconds (the compiler caches them, so the rulebook's own check is then free)."""

    def __init__(self, concurrency: int = 2, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._slots = asyncio.Semaphore(concurrency)

    async def check(self, structure: Structure) -> None:
        """Raise APIError (400, the engine's message) if the structure cannot be enforced."""
        async with self._slots:
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(check_structured_outputs, structure.params), self.timeout
                )
            except ValueError as exc:
                raise APIError(400, str(exc), structure.param) from None
            except TimeoutError:
                raise APIError(
                    400,
                    f"{structure.param}: compiling it took longer than {self.timeout:g} s",
                    structure.param,
                ) from None
