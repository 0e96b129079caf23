"""The precision side by side (bench/precision.py) without engines or llama.cpp: agreement
bookkeeping, which llama.cpp types run, the turns of the timing and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llamacpp, precision
from bench.cpu_step import PromptSet, agreement, share

LLAMA = llamacpp.LlamaCpp(
    server=Path("/c/bin/llama-server"), bench=Path("/c/bin/llama-bench"), gguf=Path("/c/m.gguf")
)
SETS = [
    PromptSet("workload", [[1, 2], [3]], [4, 2], ignore_eos=True),
    PromptSet("chat", [[5, 6, 7]], [128], ignore_eos=False),
]


def test_agreement_counts_the_tokens_before_each_first_difference():
    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert agreement(reference, reference) == (9, 9)
    # differs at 2 / stops at EOS after 1 (shorter) / runs on past the reference (longer)
    assert agreement([[1, 2, 0, 4], [5], [7, 8, 9, 10]], reference) == (2 + 1 + 3, 9)
    assert agreement([[0, 2, 3, 4], [5, 6], [7, 8, 9]], reference) == (0 + 2 + 3, 9)
    with pytest.raises(ValueError):  # one list per request, in order
        agreement([[1, 2, 3, 4]], reference)
    assert share((6, 9)) == "6/9 (66.7%)"


def test_bf16_runs_in_llama_cpp_only_where_the_cpu_has_avx512_bf16():
    assert precision.gguf_types({"avx512_bf16": True}) == (["F32", "BF16", "Q8_0"], {})
    types, missing = precision.gguf_types({"avx512_bf16": False, "avx512f": True})
    assert types == ["F32", "Q8_0"]
    assert missing == {"BF16": "the CPU has no avx512_bf16"}


def test_llama_tokens_sends_every_set_to_one_server_and_splits_them_back(monkeypatch):
    sent = []

    def greedy_tokens(llama, requests, threads, log):
        sent.append((llama, requests, threads))
        return [[i] for i in range(len(requests))]

    monkeypatch.setattr(llamacpp, "greedy_tokens", greedy_tokens)
    assert precision.llama_tokens(LLAMA, SETS, threads=2) == [[[0], [1]], [[2]]]
    assert sent == [(LLAMA, [([1, 2], 4, True), ([3], 2, True), ([5, 6, 7], 128, False)], 2)]


def test_turns_alternate_engines_and_keep_each_best():
    keys = precision.interleaved(
        [("skiff", "fp32"), ("skiff", "bf16"), ("skiff", "int8"), ("skiff", "q8_0")],
        [("llama.cpp", "F32"), ("llama.cpp", "Q8_0")],
    )
    assert keys == [
        ("skiff", "fp32"), ("llama.cpp", "F32"), ("skiff", "bf16"), ("llama.cpp", "Q8_0"),
        ("skiff", "int8"), ("skiff", "q8_0"),
    ]  # fmt: skip
    ran = []
    rates = {"a": iter([3.0, 5.0, 4.0]), "b": iter([2.0, 1.0, 1.5])}

    def measure(name: str) -> float:
        ran.append(name)
        return next(rates[name])

    runs = {("x", name): (lambda name=name: measure(name)) for name in ("a", "b")}
    assert precision.take_turns(runs, rounds=3) == {("x", "a"): 5.0, ("x", "b"): 2.0}
    assert ran == ["a", "b"] * 3


def result() -> precision.Precision:
    def row(engine, name, tok_s, workload, chat):
        return precision.Row(engine, name, tok_s, {"workload": (workload, 100), "chat": (chat, 50)})

    return precision.Precision(
        rows=[
            row("skiff", "fp32", 100.0, 100, 50),
            row("skiff", "bf16", 130.0, 95, 40),
            row("skiff", "int8", 150.0, 80, 30),
            row("skiff", "q8_0", 180.0, 60, 25),
            row("llama.cpp", "F32", 110.0, 100, 50),
            row("llama.cpp", "Q8_0", 200.0, 50, 20),
        ],
        cross={"workload": (100, 100), "chat": (49, 50)},
        skiff_threads=2,
        llama_threads=[2],
        missing={"BF16": "the CPU has no avx512_bf16"},
    )


def test_ratio_lines_pair_each_format_with_its_llama_cpp_peer():
    assert result().ratio_lines() == [
        "fp32 speed vs llama.cpp F32: 0.91",  # no BF16 row: no bf16 line
        "int8 speed vs llama.cpp Q8_0: 0.90 (skiff q8_0 180.0 / 200.0 tok/s; skiff int8 0.75)",
        "int8 greedy agreement with fp32 vs llama.cpp Q8_0, workload: skiff q8_0 60.0%, "
        "skiff int8 80.0%, llama.cpp Q8_0 50.0%",
        "int8 greedy agreement with fp32 vs llama.cpp Q8_0, chat: skiff q8_0 50.0%, "
        "skiff int8 60.0%, llama.cpp Q8_0 40.0%",
    ]
    no_q8 = result()
    no_q8.rows = [r for r in no_q8.rows if r.precision != "Q8_0"]
    assert no_q8.ratio_lines()[-1] == "int8 speed vs llama.cpp Q8_0 is missing"
    with_bf16 = result()
    with_bf16.missing = {}
    missing_bf16 = "bf16 speed vs llama.cpp BF16 is missing"
    assert with_bf16.ratio_lines()[1:4] == [missing_bf16, *result().ratio_lines()[1:3]]
    with_bf16.rows += [
        precision.Row("skiff", "bf16_dot", 160.0, {"workload": (90, 100), "chat": (35, 50)}),
        precision.Row("llama.cpp", "BF16", 150.0, {"workload": (85, 100), "chat": (30, 50)}),
    ]
    assert with_bf16.ratio_lines()[1:4] == [
        "bf16 speed vs llama.cpp BF16: 1.07 (skiff bf16_dot 160.0 / 150.0 tok/s; skiff bf16 0.87)",
        "bf16 greedy agreement with fp32 vs llama.cpp BF16, workload: skiff bf16_dot 90.0%, "
        "skiff bf16 95.0%, llama.cpp BF16 85.0%",
        "bf16 greedy agreement with fp32 vs llama.cpp BF16, chat: skiff bf16_dot 70.0%, "
        "skiff bf16 80.0%, llama.cpp BF16 60.0%",
    ]


def test_report_and_markdown_carry_every_row_the_sanity_line_and_the_command():
    report = result().report()
    assert report[0].endswith("agreement with own fp32: workload / chat")
    assert report[4].split() == ["skiff", "q8_0", "180.0", "60/100", "(60.0%)", "/", "25/50",
                                 "(50.0%)"]  # fmt: skip
    assert report[-2:] == [
        "llama.cpp F32 against skiff fp32: workload 100/100 (100.0%), chat 49/50 (98.0%)",
        "llama.cpp BF16 left out: the CPU has no avx512_bf16",
    ]
    md = result().markdown("python bench/precision.py --rounds 3", "cpu: AMD EPYC")
    assert "Command: `python bench/precision.py --rounds 3`" in md
    assert "| llama.cpp | Q8_0 | 200.0 | 50/100 (50.0%) | 20/50 (40.0%) |" in md
    assert "int8 speed vs llama.cpp Q8_0: 0.90" in md
    assert result().as_json()["rows"][0] == {
        "engine": "skiff",
        "precision": "fp32",
        "tok_s": 100.0,
        "agreement": {"workload": (100, 100), "chat": (50, 50)},
    }
