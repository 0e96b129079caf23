"""From an API request to per-choice `SamplingParams`, with the checks that need the model.

Ranges that do not depend on the model are checked by the pydantic models; here: token ids
inside the vocabulary, the context length (vLLM's wording), greedy with n > 1, min_tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from services.gateway.errors import APIError
from services.gateway.protocol import SamplingFields
from shared.sampling_params import SamplingParams, SamplingParamsError, validate_sampling_params
from shared.tokenizer import Tokenizer

_PASS_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise APIError(
                400, f"token id {token_id} is out of vocabulary (vocab size is {vocab_size})", param
            )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str = "prompt"
) -> int:
    """The completion budget; 400 when the prompt plus the request exceeds the context."""
    if prompt_len == 0:
        raise APIError(400, "The decoder prompt cannot be empty", prompt_param)
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your request has {prompt_len} input tokens. Please "
            "reduce the length of the input messages.",
            prompt_param,
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {prompt_len + requested} tokens "
            f"({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    return requested


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        check_token_ids([token_id], vocab_size, "logit_bias")
        parsed[token_id] = value
    return parsed


def _bad_words(words: list[str] | None, tokenizer: Tokenizer) -> list[list[int]] | None:
    """Each word as token ids, with and without a leading space (as vLLM does)."""
    if not words:
        return None
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and text.strip():
                sequences[ids] = None
    return [list(ids) for ids in sequences] or None


def build_sampling_params(
    req: SamplingFields,
    tokenizer: Tokenizer,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """Parameters of one choice (n is always 1: each choice is its own engine request)."""
    vocab = tokenizer.vocab_size
    check_token_ids(req.stop_token_ids or (), vocab, "stop_token_ids")
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise APIError(400, "allowed_token_ids must not be empty", "allowed_token_ids")
        check_token_ids(req.allowed_token_ids, vocab, "allowed_token_ids")
    if req.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {req.min_tokens}",
            "min_tokens",
        )
    fields = {name: getattr(req, name) for name in _PASS_THROUGH if getattr(req, name) is not None}
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias, vocab),
        allowed_token_ids=req.allowed_token_ids,
        bad_words_token_ids=_bad_words(req.bad_words, tokenizer),
        **fields,
    )
    try:
        validate_sampling_params(params, vocab)
    except SamplingParamsError as exc:
        raise APIError(400, exc.message, exc.param) from exc
    if params.greedy and req.n > 1:
        raise APIError(400, f"n must be 1 when using greedy sampling, got {req.n}", "n")
    return params


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: its own seed (seed + index) when a seed is given."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index + 2**63) % 2**64 - 2**63  # stay inside int64
    return msgspec.structs.replace(params, seed=seed)
