"""Stop strings, incremental detokenization and per-choice state (pure logic)."""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis
import hypothesis.strategies as st

from services.gateway.choice import ChoiceSpec, ChoiceState
from services.gateway.stop_strings import StopStringMatcher
from shared.tokenizer import Tokenizer
from shared.wire import (
    SamplingParams,
    TokenDelta,
)
from tests.gateway.fakes import EOS

# ---- pure logic ---------------------------------------------------------------------------


def test_stop_matcher_holds_back_partial_matches():
    m = StopStringMatcher(["world"])
    assert m.feed("Hello w") == ("Hello ", None)
    assert m.feed("on") == ("won", None)
    assert m.feed("derful wor") == ("derful ", None)
    assert m.feed("ld and more") == ("", "world")


def test_stop_matcher_include_and_earliest():
    m = StopStringMatcher(["cd", "b"], include_in_output=True)
    assert m.feed("a") == ("a", None)
    assert m.feed("bcd") == ("b", "b")
    m = StopStringMatcher(["abc"], include_in_output=True)
    assert m.feed("xab") == ("xab", None)
    assert m.feed("cz") == ("c", "abc")
    m = StopStringMatcher(["xyz"])
    assert m.feed("ax") == ("a", None)
    assert m.flush() == "x"


@hypothesis.settings(max_examples=300, deadline=None, database=None)
@hypothesis.given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
@hypothesis.example(text="abcd", stops=["abcd", "c"], cuts=[3], include=False)
@hypothesis.example(text="xabc", stops=["bc", "ab"], cuts=[], include=True)
def test_stop_matcher_matches_reference(text, stops, cuts, include):
    """Fed in any pieces, the matcher stops at the stop string that completes first."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        _, pos, stop = min(hits)
        expected = text[: pos + len(stop)] if include else text[:pos]
    else:
        stop, expected = None, text
    matcher = StopStringMatcher(stops, include)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    released, found = "", None
    for a, b in itertools.pairwise(bounds):
        piece, found = matcher.feed(text[a:b])
        released += piece
        assert not any(s in released for s in stops) or include
        if found:
            break
    if found is None:
        released += matcher.flush()
    assert (released, found) == (expected, stop)


def _state(
    tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True, **params: Any
) -> ChoiceState:
    spec = ChoiceSpec(
        0,
        "r-0",
        tokenizer.encode("Say:"),
        SamplingParams(**params),
        stop,
        skip_special_tokens=skip_special_tokens,
    )
    return ChoiceState(spec, tokenizer)


def _feed(state: ChoiceState, tokens: list[int], finish: str | None = None) -> list[str]:
    out = []
    for i, token in enumerate(tokens):
        last = finish if i == len(tokens) - 1 else None
        out.append(
            state.process(TokenDelta(req_id="r-0", new_token_ids=[token], finish_reason=last)).text
        )
    return out


def test_choice_stop_string_across_token_boundary(tokenizer):
    tokens = tokenizer.encode("Hello world, again", add_special_tokens=False)
    assert tokenizer.token_strs(tokens)[:2] == ["Hello", " world"]
    state = _state(tokenizer, ["lo wor"])
    pieces = _feed(state, tokens)
    assert "".join(pieces) == "Hel"
    assert pieces[0] == "Hel"  # "lo" is held back: it may start the stop string
    assert (state.finish_reason, state.stop_reason) == ("stop", "lo wor")
    assert state.num_tokens == 2  # tokens after the stop string are not consumed


def test_choice_multibyte_split_across_tokens(tokenizer):
    text = "日本語 🎉 ok"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # characters really are split across tokens
    pieces = _feed(_state(tokenizer, []), tokens, finish="length")
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # a token that only carries part of a character shows nothing yet


def test_choice_hides_eos_and_reports_stop_token(tokenizer):
    tokens = tokenizer.encode("Hi there", add_special_tokens=False)
    state = _state(tokenizer, [], skip_special_tokens=False)
    assert "".join(_feed(state, [*tokens, EOS], finish="stop")) == "Hi there"
    assert state.stop_reason is None and state.num_tokens == len(tokens) + 1
    state = _state(tokenizer, [], stop_token_ids=[tokens[-1]])
    delta = TokenDelta(
        req_id="r-0", new_token_ids=tokens, finish_reason="stop", stop_token_id=tokens[-1]
    )
    assert state.process(delta).text == "Hi"
    assert state.stop_reason == tokens[-1]


def test_token_bytes_are_exact(tokenizer):
    tokens = tokenizer.encode("é日🎉", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in tokens) == "é日🎉".encode()
    assert tokenizer.token_bytes(EOS) == b"<|im_end|>"
