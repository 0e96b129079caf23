"""bench/kv_tiers.py: its workload, tier sizes and metric arithmetic, and a tiny run of all three
modes on real stacks whose printed lines must parse (not meet the targets)."""

from __future__ import annotations

import json
import re

import pytest

from bench.kv_tiers import (
    BLOCK_BYTES,
    GIB,
    ModeResult,
    Turn,
    chat_workload,
    hit_rates,
    main,
    output_differences,
    parse_metrics,
    ratio_lines,
    table,
    tier_sizes,
)


class WordTokenizer:
    """One token per character: lengths are easy to check."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_workload_is_seeded_and_sized():
    w = chat_workload(WordTokenizer(), 3, 4, (10, 20), max_tokens=8, think_time=2.0, seed=5)
    assert w == chat_workload(WordTokenizer(), 3, 4, (10, 20), 8, 2.0, seed=5)
    assert w != chat_workload(WordTokenizer(), 3, 4, (10, 20), 8, 2.0, seed=6)
    assert all(10 <= len(m) <= 20 for msgs in w.messages for m in msgs)
    assert [len(msgs) for msgs in w.messages] == [4, 4, 4] and w.num_turns == 4
    assert all(t[0] == 0.0 and len(t) == 4 for t in w.think)
    assert all(0.0 <= s <= 2.0 for s in w.starts)
    finals = w.final_history_tokens()
    assert finals[0] == len(w.system) + sum(map(len, w.messages[0])) + 4 * 8


def test_tier_sizes_follow_the_live_history():
    w = chat_workload(WordTokenizer(), 8, 6, (100, 200), max_tokens=32, seed=0)
    sizes = tier_sizes(w)
    assert sizes.live_blocks >= sum(w.final_history_tokens()) // 16
    assert sizes.device_blocks == -(-sizes.live_blocks // 4)
    assert sizes.host_blocks >= sizes.live_blocks
    assert sizes.split_host_blocks + sizes.split_disk_blocks == sizes.host_blocks
    assert sizes.split_host_blocks < sizes.live_blocks
    off = sizes.runner("off", "/m", "/d")
    assert off.kv_offloading_size == 0 and off.kv_offloading_disk_size == 0
    assert off.kv_cache_gib * GIB == pytest.approx(sizes.device_blocks * BLOCK_BYTES)
    split = sizes.runner("host+disk", "/m", "/d")
    assert split.kv_offloading_disk_path == "/d"
    assert split.kv_offloading_disk_size * GIB == pytest.approx(
        sizes.split_disk_blocks * BLOCK_BYTES
    )


def test_hit_rates_from_two_scrapes():
    page = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
vllm:prefix_cache_queries_total{model_name="bench"} %d
vllm:prefix_cache_hits_total{model_name="bench"} %d
vllm:external_prefix_cache_queries_total{model_name="bench"} %d
vllm:external_prefix_cache_hits_total{model_name="bench"} %d
skiff_kv_tier_hits_total{origin="host"} %d
skiff_kv_tier_hits_total{origin="disk"} 0.0
"""
    before = parse_metrics(page % (100, 50, 50, 0, 0))
    after = parse_metrics(page % (1100, 350, 750, 560, 480))
    assert before["skiff_kv_tier_hits_total{origin=host}"] == 0.0
    rates = hit_rates(before, after, prompt_tokens=960)
    assert rates["device"] == pytest.approx(0.3)
    assert rates["external"] == pytest.approx(0.8)
    assert rates["host"] == pytest.approx(0.5)
    assert rates["disk"] == 0.0 and rates["remote"] == 0.0


def mode_result(mode: str, ttfts: list[float], texts: list[str]) -> ModeResult:
    turns = [
        Turn(0, i, 100, t, 4, text) for i, (t, text) in enumerate(zip(ttfts, texts, strict=True))
    ]
    hits = dict.fromkeys(("device", "host", "disk", "remote", "external"), 0.25)
    return ModeResult(mode, {}, 10.0, turns, hits)


def test_lines_ratios_and_differences():
    results = {
        "off": mode_result("off", [3.0, 6.0, 9.0], ["a", "b", "c"]),
        "host": mode_result("host", [1.0, 2.0, 3.0], ["a", "b", "c"]),
        "host+disk": mode_result("host+disk", [1.0, 1.5, 4.0], ["a", "x", "c"]),
    }
    answers = {m: r.answers() for m, r in results.items()}
    assert output_differences(answers["off"], [answers["host"], answers["host+disk"]]) == (1, 6)
    assert output_differences(answers["off"], [{(0, 1): "b", (0, 2): "z"}]) == (1, 2)
    assert ratio_lines(results, {}) == [
        "TTFT p50 ratio tiers off / on: 3.00",
        "TTFT p50 ratio tiers off / host+disk: 4.00",
    ]
    assert results["off"].summary["output_tokens_per_s"] == pytest.approx(1.2)
    del results["host"]
    failures = {"host": "no token for 120 s after 3 of 96 turns"}
    assert ratio_lines(results, failures)[0] == (
        "TTFT p50 ratio tiers off / on is missing: host mode no token for 120 s after 3 of 96 turns"
    )
    rows = table(results, failures)
    assert rows[2] == "host       failed: no token for 120 s after 3 of 96 turns"
    assert rows[3].split()[:3] == ["host+disk", "1.500", "4.000"]


@pytest.mark.e2e
def test_tiny_run_prints_lines_that_parse(tmp_path, capsys, smollm2_dir):
    out = tmp_path / "kv.json"
    tiny = ["--conversations", "2", "--turns", "2", "--user-tokens", "20,40", "--max-tokens", "4"]
    main([*tiny, "--think-time", "0.2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert re.search(r"^CPU model: \S.*$", printed, re.M)
    for mode in ("off", "host", "host+disk"):
        row = re.search(rf"^{re.escape(mode)} +(\d+\.\d+) +(\d+\.\d+) .*%$", printed, re.M)
        assert row, mode
    differences = re.search(r"^output differences: (\d+)$", printed, re.M)
    ratios = re.findall(r"^TTFT p50 ratio tiers off / (on|host\+disk): (\d+\.\d\d)$", printed, re.M)
    assert differences and [r[0] for r in ratios] == ["on", "host+disk"]
    report = json.loads(out.read_text())
    assert report["output_differences"] == int(differences.group(1))
    assert report["answers_compared"] == 8  # 2 conversations x 2 turns, in both tier modes
    assert set(report["modes"]) == {"off", "host", "host+disk"}
    assert report["command"].startswith("python -m bench.kv_tiers --conversations 2")
