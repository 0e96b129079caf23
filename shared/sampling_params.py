"""The rulebook for sampling parameters: the `SamplingParams` wire struct, its constants,
derived properties, the one validator and the context-length rules (vLLM's ranges and wording).

The gateway turns `SamplingParamsError` into a 400 with `param` set; the scheduler and the
offline `LLM` call the same `validate_sampling_params`. `param` names the API field: the
`SamplingParams` field name, except `bad_words_token_ids`, which is reported as `bad_words`
(the field a client sends). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar, overload

import msgspec

from shared.structured_outputs import StructuredOutputsParams, check_structured_outputs

GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
DEFAULT_MAX_TOKENS = 16  # vLLM's default, and OpenAI's for /v1/completions
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 2.0
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling parameters (vLLM's names and defaults); checked by
    `validate_sampling_params`.

    `top_k` of -1 (or 0) disables top-k; `max_tokens` of None means "up to the context length".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # What `logprobs` report: "raw_logprobs" (default), "raw_logits", "processed_logprobs" or
    # "processed_logits" (after penalties, temperature and filters), as vLLM's option.
    logprobs_mode: str = "raw_logprobs"
    # A JSON schema, regex, choice or grammar the output must follow, enforced by the worker's
    # sampler (shared/structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def logprobs_mode_index(self) -> int:
        return LOGPROBS_MODES.index(self.logprobs_mode)

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of n, as its own request: n=1 and, when seeded, the seed
        `seed + index` (wrapped to stay inside int64), so choices differ but are reproducible."""
        seed = None if self.seed is None else wrap_int64(self.seed + index)
        return msgspec.structs.replace(self, n=1, seed=seed)


def wrap_int64(x: int) -> int:
    """The int64 with the same low 64 bits as `x`."""
    return (x - INT64_MIN) % 2**64 + INT64_MIN


T = TypeVar("T")


@overload
def is_greedy(temperature: float) -> bool: ...
@overload
def is_greedy(temperature: T) -> T: ...
def is_greedy(temperature: Any) -> Any:
    """The one greedy rule: a bool for a float, an elementwise mask for a numpy array or a
    torch tensor of temperatures."""
    return temperature < GREEDY_EPS


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def validate_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise `SamplingParamsError` for the first invalid parameter, else return None."""
    for check in _CHECKS:
        check(params, vocab_size)


def _fail(message: str, param: str) -> NoReturn:
    raise SamplingParamsError(message, param)


def _check_n(p: SamplingParams, _: int) -> None:
    if p.n < 1:
        _fail(f"n must be at least 1, got {p.n}.", "n")
    if p.n > 1 and math.isfinite(p.temperature) and p.greedy:
        _fail(f"n must be 1 when using greedy sampling, got {p.n}.", "n")


def _check_penalties(p: SamplingParams, _: int) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
            _fail(f"{name} must be in [-2, 2], got {value}.", name)
    rep = p.repetition_penalty
    if not math.isfinite(rep):
        _fail(f"repetition_penalty must be a finite number, got {rep}.", "repetition_penalty")
    if rep <= 0.0:
        _fail(f"repetition_penalty must be greater than zero, got {rep}.", "repetition_penalty")


def _check_temperature(p: SamplingParams, _: int) -> None:
    t = p.temperature
    if not math.isfinite(t):
        _fail(f"temperature must be a finite number, got {t}.", "temperature")
    if t < 0.0:
        _fail(f"temperature must be non-negative, got {t}.", "temperature")
    if t > MAX_TEMPERATURE:
        _fail(f"temperature must be in [0, 2], got {t}.", "temperature")


def _check_filters(p: SamplingParams, _: int) -> None:
    if not 0.0 < p.top_p <= 1.0:
        _fail(f"top_p must be in (0, 1], got {p.top_p}.", "top_p")
    if p.top_k < -1:
        _fail(f"top_k must be 0 (disable), or at least 1, got {p.top_k}.", "top_k")
    if not 0.0 <= p.min_p <= 1.0:
        _fail(f"min_p must be in [0, 1], got {p.min_p}.", "min_p")


def _check_lengths(p: SamplingParams, _: int) -> None:
    if p.max_tokens is not None and p.max_tokens < 1:
        _fail(f"max_tokens must be at least 1, got {p.max_tokens}.", "max_tokens")
    if p.min_tokens < 0:
        _fail(f"min_tokens must be greater than or equal to 0, got {p.min_tokens}.", "min_tokens")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail(
            f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, "
            f"got {p.min_tokens}.",
            "min_tokens",
        )


def _check_logprobs(p: SamplingParams, _: int) -> None:
    for name, label in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(p, name)
        if value is None:
            continue
        if value < 0:
            _fail(f"{name} must be non-negative, got {value}.", name)
        if value > MAX_LOGPROBS:
            _fail(
                f"Requested {label} logprobs of {value}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                name,
            )
    if p.logprobs_mode not in LOGPROBS_MODES:
        _fail(
            f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {p.logprobs_mode!r}.",
            "logprobs_mode",
        )


def _check_seed(p: SamplingParams, _: int) -> None:
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        _fail(f"seed must fit in a signed 64-bit integer, got {p.seed}.", "seed")


def _check_logit_bias(p: SamplingParams, vocab_size: int) -> None:
    if not p.logit_bias:
        return
    check_token_ids(p.logit_bias, vocab_size, "logit_bias")
    for token_id, bias in p.logit_bias.items():
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            _fail(
                f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.",
                "logit_bias",
            )


def _check_token_lists(p: SamplingParams, vocab_size: int) -> None:
    check_token_ids(p.stop_token_ids, vocab_size, "stop_token_ids")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            _fail("allowed_token_ids is not None and empty!", "allowed_token_ids")
        check_token_ids(p.allowed_token_ids, vocab_size, "allowed_token_ids")
    for word in p.bad_words_token_ids or ():
        if not word:
            _fail("bad_words cannot contain an empty word.", "bad_words")
        check_token_ids(word, vocab_size, "bad_words")


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Every id inside the vocabulary (sampling parameters, prompts given as token ids)."""
    invalid = [t for t in token_ids if not 0 <= t < vocab_size]
    if invalid:
        _fail(
            f"token_id(s) {invalid} in {param} contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            param,
        )


def _check_structured_outputs(p: SamplingParams, _: int) -> None:
    if p.structured_outputs is not None:
        try:
            check_structured_outputs(p.structured_outputs)
        except ValueError as exc:
            _fail(str(exc), "structured_outputs")


_CHECKS: tuple[Callable[[SamplingParams, int], None], ...] = (
    _check_n,
    _check_temperature,
    _check_filters,
    _check_penalties,
    _check_lengths,
    _check_logprobs,
    _check_seed,
    _check_logit_bias,
    _check_token_lists,
    _check_structured_outputs,
)


# ---- context length -----------------------------------------------------------------------


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """An engine needs at least one free position after the prompt (vLLM's wording)."""
    if num_prompt_tokens == 0:
        _fail("The decoder prompt cannot be empty", param)
    if num_prompt_tokens >= max_model_len:
        _fail(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.",
            param,
        )


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, prompt_param: str = "prompt"
) -> int:
    """The completion budget the API grants: the rest of the context when none is requested;
    a request whose prompt plus `requested` exceeds the context is refused."""
    check_prompt_fits(num_prompt_tokens, max_model_len, prompt_param)
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        _fail(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"messages, {requested} in the completion). Please reduce the length of the "
            "messages or completion.",
            "max_tokens",
        )
    return requested
