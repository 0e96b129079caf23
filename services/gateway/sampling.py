"""From an API request to `SamplingParams`, checked by the one rulebook in
`shared.sampling_params` (its `SamplingParamsError` becomes a 400 with `param`, see
`services.gateway.errors`). What is left here is what only the API has: parsing `logit_bias`
keys, tokenizing `bad_words`, the `stop` strings the gateway matches itself, and the sizes of
the lists and texts among them (`check_sizes`), bounded before any of them is processed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.gateway.errors import APIError
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.schemas import SamplingFields
from shared.sampling_params import SamplingParams, SamplingParamsError, validate_sampling_params
from shared.structured_outputs import StructuredOutputsParams
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


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


_MAX_TOKEN_ID_CHARS = 20  # the longest key that can name a token id


def check_sizes(req: SamplingFields, encoder: PromptEncoder) -> None:
    """Bound what the rulebook and the matchers would otherwise walk through at any size: no
    token-id list or `logit_bias` longer than the vocabulary, no `stop` or `bad_words` text
    longer than the context can hold (it could never match)."""
    vocab_size = encoder.tokenizer.vocab_size
    lists = {
        "logit_bias": req.logit_bias,
        "stop_token_ids": req.stop_token_ids,
        "allowed_token_ids": req.allowed_token_ids,
    }
    for param, values in lists.items():
        if values is not None and len(values) > vocab_size:
            raise APIError(
                400, f"{param} has {len(values)} entries, more than the {vocab_size} tokens", param
            )
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    texts = {"stop": ("stop strings", stop), "bad_words": ("bad words", req.bad_words or [])}
    for param, (what, strings) in texts.items():
        encoder.check_chars(sum(len(t) for t in strings), param, what)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            if len(key) > _MAX_TOKEN_ID_CHARS:
                raise ValueError
            parsed[int(key)] = value
        except ValueError:
            shown = key if len(key) <= _MAX_TOKEN_ID_CHARS else key[:_MAX_TOKEN_ID_CHARS] + "..."
            raise APIError(
                400, f"logit_bias key {shown!r} is not a token id", "logit_bias"
            ) from None
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
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's parameters for all its `n` choices (`SamplingParams.for_choice` splits
    them into one engine request per choice); raises `SamplingParamsError` when invalid.
    `structured_outputs` should be checked already (`StructureChecker`), off the event loop."""
    fields = {name: getattr(req, name) for name in _PASS_THROUGH if getattr(req, name) is not None}
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words_token_ids=_bad_words(req.bad_words, tokenizer),
        structured_outputs=structured_outputs,
        **fields,
    )
    validate_sampling_params(params, tokenizer.vocab_size)
    return params


@contextmanager
def api_field_names(names: dict[str, str]) -> Iterator[None]:
    """Report rulebook errors under the API's own field names (chat sends `logprobs` as
    `top_logprobs`, and `max_tokens` possibly as `max_completion_tokens`)."""
    try:
        yield
    except SamplingParamsError as exc:
        exc.param = names.get(exc.param, exc.param)
        raise
