"""The long-prompt section of `make bench` without a model or llama.cpp: llama-bench's prefill
command and JSON, prompts, latency windows and the printed ratio lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llamacpp
from bench.long_prompts import LongPrompts, cut_prompts, gaps, label, percentiles

LLAMA = llamacpp.LlamaCpp(
    server=Path("/c/bin/llama-server"), bench=Path("/c/bin/llama-bench"), gguf=Path("/c/m.gguf")
)

PREFILL_JSON = json.dumps(
    [
        {"n_threads": 1, "n_prompt": 2048, "n_gen": 0, "avg_ts": 150.0},
        {"n_threads": 2, "n_prompt": 2048, "n_gen": 0, "avg_ts": 280.0},
        {"n_threads": 2, "n_prompt": 8000, "n_gen": 0, "avg_ts": 190.0},
        {"n_threads": 2, "n_prompt": 0, "n_gen": 64, "avg_ts": 49.0},
    ]
)


def test_llama_bench_prefill_command_and_json():
    cmd = llamacpp.prefill_command(LLAMA, [1, 2], [512, 2048, 8000])
    assert cmd[cmd.index("-p") + 1] == "512,2048,8000"
    assert cmd[cmd.index("-n") + 1] == "0"
    assert cmd[cmd.index("-t") + 1] == "1,2"
    assert llamacpp.parse_prefill_json(PREFILL_JSON) == {2048: 280.0, 8000: 190.0}
    with pytest.raises(ValueError, match="no prompt-processing"):
        llamacpp.parse_prefill_json(json.dumps([{"n_prompt": 0, "n_gen": 64, "avg_ts": 1.0}]))


def test_prompts_are_distinct_cuts_of_the_asked_lengths():
    tokens = list(range(10_000))
    prompts = cut_prompts(tokens, [512, 2048, 2048], seed=1)
    assert [len(p) for p in prompts] == [512, 2048, 2048]
    assert prompts[1][0] != prompts[2][0]
    assert all(p == tokens[p[0] : p[0] + len(p)] for p in prompts)


def test_gaps_within_a_window_and_percentiles():
    stamps = [0.0, 1.0, 3.0, 6.0, 10.0]
    assert gaps(stamps) == [1.0, 2.0, 3.0, 4.0]
    assert gaps(stamps, since=1.0, until=6.0) == [2.0, 3.0]
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p99": 3.0, "max": 3.0, "n": 3}
    assert percentiles([]) == {}


def test_prefill_ratio_lines():
    result = LongPrompts([512, 2048, 8000], {512: 1.0, 2048: 4.096, 8000: 40.0})
    result.llama_prefill_tok_s = {512: 400.0, 2048: 400.0, 8000: 250.0}
    assert result.ratio_lines() == [
        "prefill ratio vs llama.cpp at 2k: 1.25",
        "prefill ratio vs llama.cpp at 8k: 0.80",
    ]
    assert [label(n) for n in (512, 2048, 8000)] == ["512", "2k", "8k"]


def test_prefill_ratio_lines_say_why_they_are_missing():
    result = LongPrompts([512, 2048], {512: 1.0, 2048: 4.0}, llama_missing="--no-llama-cpp")
    assert result.ratio_lines() == [
        "prefill ratio vs llama.cpp at 2k is missing: --no-llama-cpp",
        "prefill ratio vs llama.cpp at 8k is missing: --no-llama-cpp",
    ]
