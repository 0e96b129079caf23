"""Request bodies of the HTTP API (OpenAI fields plus vLLM's extra sampling fields).

Types are declared here; the ranges of sampling parameters are checked once, by
`shared.sampling_params` (a 400 with `param`, vLLM's wording). What only the API limits
(choices per request, stop strings) is bounded here. Unknown fields are ignored, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from shared.sampling_params import DEFAULT_MAX_TOKENS

MAX_N = 128
MAX_STOP = 64


def _require_utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid UTF-8 (it holds a lone surrogate)") from None
    return value


def _require_utf8_json(value: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("object is not valid UTF-8 (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_require_utf8)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_require_utf8_json)]
TokenId = int  # checked against the vocabulary by shared.sampling_params


class _Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


JsonSchema = JsonObject | Text  # a schema object, or the same as JSON text
# vLLM's `guided_decoding_backend` values: accepted, and ignored (the workers use llguidance).
GuidedDecodingBackend = Literal[
    "auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"
]


class JsonSchemaFormat(_Body):
    name: Text = "response"
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra parameter (exactly one constraint)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    json_: JsonSchema | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused with a clear message: not supported


class StructuredOutputsFields(_Body):
    """The ways to ask for structured output: OpenAI's `response_format`, vLLM's
    `structured_outputs` and its older `guided_*` names."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: GuidedDecodingBackend | None = None
    guided_whitespace_pattern: Text | None = None  # refused: not supported


class SamplingFields(StructuredOutputsFields):
    """Fields shared by completions and chat completions; None means the model's default."""

    model: Text | None = None
    n: int = Field(1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=2**31 - 1)  # bounded so that it fits the wire
    min_p: float | None = None
    seed: int | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM's: with the scheduler's priority policy, lower values are scheduled first (and
    # preempted last). Bounded so that it fits the wire.
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text, as the model produced it


class ChatToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ChatToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message answers this call


class FunctionDefinition(_Body):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class TokenizeCompletionRequest(_Body):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body; `model` (skiff's) names the served model that
    gets the adapter (default: the gateway's first)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = Field(default=None, max_length=256)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter body (`lora_int_id` is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None
