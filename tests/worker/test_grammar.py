"""Structured outputs in the worker: the batch's grammar bitmasks against a naive reference on a
tiny byte-level vocabulary, the sampler's mask step, and matchers that follow their requests
through the persistent batch (replay on entry, condense, removal)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.worker.grammar import GrammarCompiler
from services.worker.grammar_bitmask import GrammarBitmask, bitmask_words
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampler import Sampler
from services.worker.sampler.metadata import GrammarMask
from services.worker.sampler.processors import apply_grammar_mask
from services.worker.sampling_metadata import build_sampling_metadata
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.unit

EOS = 0
TOKENS = ["<eos>", "a", "b", "c", "ab", "ba", "abc", "-", "x", "bc", "cab"]
VOCAB = 14  # model vocabulary: the ids past the tokenizer's never follow a grammar

# Finite languages, each with every string it accepts (the reference enumerates them).
SPECS = [
    (StructuredOutputsParams(choice=["abc", "ab-x", "bca", "c"]), ["abc", "ab-x", "bca", "c"]),
    (
        StructuredOutputsParams(regex="(ab|ba){1,2}c?"),
        [
            "".join(p) + c
            for n in (1, 2)
            for p in itertools.product(["ab", "ba"], repeat=n)
            for c in ("", "c")
        ],
    ),
    (
        StructuredOutputsParams(grammar='start: x "-" x\nx: "ab" | "c" | "bca"'),
        [f"{a}-{b}" for a in ("ab", "c", "bca") for b in ("ab", "c", "bca")],
    ),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer of TOKENS (ids in order; <eos> special)."""
    path = tmp_path_factory.mktemp("grammar")
    vocab = {t: i for i, t in enumerate(TOKENS)}
    merges = [("a", "b"), ("b", "a"), ("ab", "c"), ("b", "c"), ("c", "ab")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def compiler(model_dir):
    return GrammarCompiler(model_dir, VOCAB, [EOS])


def reference_mask(language: list[str], text: str) -> np.ndarray:
    """[VOCAB] bool: token t may follow `text` iff some string of the language starts with
    text + t; EOS iff `text` is in the language."""
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[EOS] = text in language
    for t, piece in enumerate(TOKENS[1:], start=1):
        allowed[t] = any(s.startswith(text + piece) for s in language)
    return allowed


def unpack(bitmask: torch.Tensor) -> np.ndarray:
    """[r, words] int32 -> [r, VOCAB] bool."""
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :VOCAB].astype(bool)


def test_batch_bitmask_equals_the_naive_reference(compiler):
    """Random walks through each language, all specs in one batch each step: every row's
    mask is exactly the reference's, EOS included."""
    rng = np.random.default_rng(0)
    fill = GrammarBitmask(max_rows=8, vocab_size=VOCAB, device=torch.device("cpu"))
    for _ in range(30):
        walks = [(compiler.matcher(spec, []), language, "") for spec, language in SPECS]
        while walks:
            masks = unpack(fill.fill([m for m, _, _ in walks]))
            survivors = []
            for (matcher, language, text), mask in zip(walks, masks, strict=True):
                np.testing.assert_array_equal(mask, reference_mask(language, text), err_msg=text)
                token = int(rng.choice(np.flatnonzero(mask)))
                if token != EOS:
                    assert matcher.consume_token(token)
                    survivors.append((matcher, language, text + TOKENS[token]))
            walks = survivors


def test_replayed_matcher_equals_one_fed_token_by_token(compiler):
    spec, _ = SPECS[1]
    fed = compiler.matcher(spec, [])
    fill = GrammarBitmask(max_rows=2, vocab_size=VOCAB, device=torch.device("cpu"))
    for token in [5, 4]:  # "ba", "ab"
        assert fed.consume_token(token)
        replayed = compiler.matcher(spec, [5, 4][: [5, 4].index(token) + 1])
        a, b = unpack(fill.fill([fed, replayed]))
        np.testing.assert_array_equal(a, b)


def test_grammar_mask_step_bans_exactly_the_unset_bits():
    torch.manual_seed(0)
    vocab, n = 100, 5
    logits = torch.randn(n, vocab)
    rows = torch.tensor([1, 3, 4])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32)
    expected = logits.clone()
    allowed = unpack_wide(bitmask, vocab)
    for i, row in enumerate(rows.tolist()):
        expected[row, ~allowed[i]] = float("-inf")
    buffer = torch.empty(3 * bitmask.shape[1] * 32)
    apply_grammar_mask(logits, GrammarMask(rows, bitmask), buffer)
    torch.testing.assert_close(logits, expected)


def unpack_wide(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor(
        [[(int(w) >> b) & 1 for w in row for b in range(32)][:vocab] for row in bitmask.tolist()],
        dtype=torch.bool,
    )


def state(req_id: str, params: SamplingParams, output: list[int] | None = None):
    return CachedRequestState(req_id, [1, 2], params, [0], 0, list(output or []))


def test_matchers_follow_their_requests_through_the_batch(compiler):
    """Built on entry with the output so far replayed, advanced by append_tokens, moved by
    condense, dropped on removal; rows without structured outputs have none."""
    choice = SamplingParams(structured_outputs=SPECS[0][0])
    batch = InputBatch(max_num_reqs=3, max_model_len=16, block_size=4, grammar=compiler)
    batch.add_request(state("plain", SamplingParams()))
    batch.add_request(state("fresh", choice))
    batch.add_request(state("moved", choice, output=[4]))  # "ab" generated elsewhere
    assert batch.has_matcher.tolist() == [False, True, True]
    batch.append_tokens(np.array([0, 1, 2]), np.array([8, 3, 7]))  # plain: any; "c"; "-"
    fill = GrammarBitmask(max_rows=3, vocab_size=VOCAB, device=torch.device("cpu"))
    sel, matchers = batch.structured(np.arange(3))
    assert sel.tolist() == [1, 2]
    fresh, moved = unpack(fill.fill(matchers))
    np.testing.assert_array_equal(fresh, reference_mask(SPECS[0][1], "c"))
    np.testing.assert_array_equal(moved, reference_mask(SPECS[0][1], "ab-"))
    batch.remove_request("plain")
    batch.condense()
    assert batch.req_ids[:2] == ["moved", "fresh"] and batch.has_matcher[:3].tolist() == [
        True,
        True,
        False,
    ]
    assert batch.matchers[2] is None
    moved_again = unpack(fill.fill(batch.structured(np.arange(1))[1]))[0]
    np.testing.assert_array_equal(moved_again, reference_mask(SPECS[0][1], "ab-"))


def test_sampler_keeps_every_row_inside_its_grammar(compiler):
    """Random logits, temperature, top-k, penalties and seeds: every sampled token is allowed;
    a complete grammar overrides min_tokens and ends the output with EOS."""
    spec, language = SPECS[1]
    params = [
        SamplingParams(temperature=1.0, seed=7, structured_outputs=spec),
        SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, structured_outputs=spec),
        SamplingParams(temperature=0.0, structured_outputs=spec),
        SamplingParams(temperature=1.0, min_tokens=8, structured_outputs=spec),
        SamplingParams(temperature=1.0),
    ]
    batch = InputBatch(max_num_reqs=len(params), max_model_len=32, block_size=4, grammar=compiler)
    for i, p in enumerate(params):
        batch.add_request(state(f"r{i}", p))
    fill = GrammarBitmask(len(params), VOCAB, torch.device("cpu"))
    sampler, texts = Sampler(seed=0), [""] * len(params)
    done = [False] * len(params)
    done[4] = True  # unconstrained: not checked
    torch.manual_seed(1)
    for _ in range(12):
        rows = np.arange(len(params))
        sel, matchers = batch.structured(rows)
        mask = GrammarMask(torch.from_numpy(sel), fill.fill(matchers))
        meta = build_sampling_metadata(batch, rows, VOCAB, (EOS,), grammar=mask)
        sampled = sampler(torch.randn(len(params), VOCAB) * 3, meta).sampled_token_ids.numpy()
        for i, token in enumerate(sampled.tolist()):
            if done[i]:
                continue
            allowed = reference_mask(language, texts[i])
            assert allowed[token], (i, texts[i], token)
            if token == EOS:
                assert texts[i] in language
                done[i] = True
            else:
                texts[i] += TOKENS[token]
        batch.append_tokens(rows, sampled)
    assert all(done), texts


def test_invalid_spec_is_refused_before_any_matcher(compiler):
    with pytest.raises(ValueError, match="regex"):
        compiler.matcher(StructuredOutputsParams(regex="(a"), [])
    with pytest.raises(ValueError, match="JSON schema"):
        compiler.matcher(StructuredOutputsParams(json=json.dumps({"type": "nope"})), [])
