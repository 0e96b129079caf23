"""One choice of a response: token deltas in, visible text and finish state out.

The scheduler stops on token ids (EOS, stop_token_ids, max_tokens); the gateway adds stop
strings. Like vLLM, the token that ended a request on EOS or a stop token id is counted but its
text is left out unless `include_stop_str_in_output` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from shared.wire import TokenDelta, TokenLogprobs


@dataclass
class ChoiceUpdate:
    """What one delta (or several merged ones) changed in a choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each token's text starts
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def merge(self, later: ChoiceUpdate) -> ChoiceUpdate:
        return ChoiceUpdate(
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            self.text_offsets + later.text_offsets,
            later.finish_reason,
            later.stop_reason,
        )


@dataclass(frozen=True)
class ChoiceSpec:
    """How a choice turns tokens into text."""

    index: int
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class ChoiceState:
    def __init__(self, spec: ChoiceSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_by_string = False
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, spec.prompt_ids, spec.skip_special_tokens
        )
        self._stops = StopStringMatcher(spec.stop, spec.include_stop_str_in_output)
        self._text_len = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, delta: TokenDelta) -> ChoiceUpdate:
        """Apply one delta; tokens after a stop string are ignored."""
        update = ChoiceUpdate(self.spec.index)
        if self.finished:
            return update
        prompt_len = len(self.spec.prompt_ids)
        self.num_cached_tokens = min(
            max(self.num_cached_tokens, delta.num_cached_tokens), prompt_len
        )
        if delta.prompt_logprobs is not None:  # one part per prefill chunk, in order
            self.prompt_logprobs = [*(self.prompt_logprobs or []), *delta.prompt_logprobs]
        engine_stopped = delta.finish_reason == "stop"
        last = len(delta.new_token_ids) - 1
        for i, token_id in enumerate(delta.new_token_ids):
            self.num_tokens += 1
            update.token_ids.append(token_id)
            update.logprobs.append(delta.logprobs[i] if i < len(delta.logprobs) else None)
            update.text_offsets.append(self._text_len)
            hide = engine_stopped and i == last and not self.spec.include_stop_str_in_output
            piece = "" if hide else self._detokenizer.step(token_id)
            self._text_len += len(piece)
            released, stop = self._stops.feed(piece)
            update.text += released
            if stop is not None:
                self.stopped_by_string = True
                self._finish(update, "stop", stop)
                return update
        if delta.finish_reason is not None:
            update.text += self._stops.flush()
            token = delta.stop_token_id
            self._finish(
                update,
                delta.finish_reason,
                token if token in self.spec.params.stop_token_ids else None,
            )
        return update

    def abort(self) -> ChoiceUpdate:
        update = ChoiceUpdate(self.spec.index)
        self._finish(update, "abort", None)
        return update

    def _finish(self, update: ChoiceUpdate, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = update.finish_reason = reason
        self.stop_reason = update.stop_reason = stop_reason
