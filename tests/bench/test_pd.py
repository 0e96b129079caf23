"""bench/pd.py: its windows, step means and ratio arithmetic, and the quick run on real stacks
(CPU and simulated workers) whose printed lines must parse, with no output differences (not
the targets: speeds are the machine's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.pd import (
    ModeResult,
    Phases,
    Stream,
    grew,
    main,
    output_differences,
    part_ratio_lines,
    step_means,
    tokens_per_chunk,
    window_gaps,
    window_tokens_per_s,
)


def test_windows_count_gaps_and_chunks_within_their_bounds() -> None:
    a = Stream(0.0, [1.0, 2.0, 4.0, 7.0], "abcd", 4)
    b = Stream(0.5, [1.5, 3.5], "xy", 0)  # cut off: no usage
    assert window_gaps([a, b], 1.0, 4.0) == [1.0, 2.0, 2.0]
    assert window_gaps([a, b], 2.0, 10.0) == [2.0, 3.0]
    assert tokens_per_chunk([a, b]) == 1.0
    assert tokens_per_chunk([Stream(0.0, [1.0, 2.0], "ab", 3)]) == 1.5
    assert tokens_per_chunk([b]) == 1.0  # none ended: a token per chunk
    assert window_tokens_per_s([a, b], 1.0, 3.0, 1.0) == pytest.approx(3 / 2.0)
    assert window_tokens_per_s([a, b], 1.0, 3.0, 2.0) == pytest.approx(3.0)
    assert window_tokens_per_s([a], 2.0, 2.0, 1.0) == 0.0


def test_phase_summary() -> None:
    steady = [Stream(0.0, [1.0, 2.0, 3.0, 5.0, 6.0], "", 5)]
    long = [Stream(2.5, [4.0, 4.5], "a", 2), Stream(3.0, [6.0], "b", 1)]
    steps = {"worker-0": {"idle": 0.1, "loaded": 0.2}}
    s = Phases(steady, long, (1.0, 3.0), (3.0, 6.0), steps, {}).summary()
    assert s["itl_idle_s"]["p99"] == 1.0 and s["itl_idle_s"]["n"] == 2
    assert s["itl_loaded_s"]["p99"] == 2.0 and s["itl_loaded_s"]["n"] == 2
    assert s["long_ttft_s"]["p50"] == 3.0 and s["long_ttft_s"]["max"] == 3.0
    assert s["steady_tokens_per_s_idle"] == pytest.approx(3 / 2.0)
    assert s["steady_tokens_per_s_loaded"] == pytest.approx(3 / 3.0)
    assert s["long_completion_tokens"] == [2, 1]
    assert s["worker_step_mean_s"] == steps


def test_step_means_and_counter_growth_between_scrapes() -> None:
    def page(s0: float, n0: float, s1: float, n1: float) -> dict[str, float]:
        return {
            "skiff_worker_step_seconds_sum{worker_id=worker-0}": s0,
            "skiff_worker_step_seconds_count{worker_id=worker-0}": n0,
            "skiff_worker_step_seconds_sum{worker_id=worker-1}": s1,
            "skiff_worker_step_seconds_count{worker_id=worker-1}": n1,
        }

    scrapes = [page(1.0, 10, 0.0, 0), page(2.0, 20, 0.0, 0), page(5.0, 30, 4.0, 8)]
    assert step_means(scrapes) == {
        "worker-0": {"idle": pytest.approx(0.1), "loaded": pytest.approx(0.3)},
        "worker-1": {"idle": 0.0, "loaded": 0.5},
    }
    before = {"skiff_pd_transfer_bytes_total": 10.0, "skiff_pd_transfer_seconds_sum": 1.0}
    after = {
        "skiff_pd_transfer_bytes_total": 30.0,
        "skiff_pd_transfer_seconds_sum": 1.5,
        "skiff_pd_transfer_seconds_bucket{le=0.1}": 3.0,
        "skiff_pd_transfer_seconds_created": 1e9,
        "vllm:num_requests_running": 2.0,
    }
    assert grew(before, after) == {
        "skiff_pd_transfer_bytes_total": 20.0,
        "skiff_pd_transfer_seconds_sum": 0.5,
    }


def mode_result(mode: str, itl_p99: float, idle_p99: float, tokens_per_s: float) -> ModeResult:
    summary = {
        "itl_idle_s": {"p99": idle_p99},
        "itl_loaded_s": {"p99": itl_p99},
        "steady_tokens_per_s_loaded": tokens_per_s,
    }
    return ModeResult("sim", mode, summary, {}, [])


def test_ratio_lines_and_output_differences() -> None:
    lines = part_ratio_lines(
        "sim",
        mode_result("colocated", 0.06, 0.01, 90.0),
        mode_result("disaggregated", 0.02, 0.01, 99.0),
    )
    assert lines == [
        "sim: ITL p99 ratio colocated / disaggregated: 3.00",
        "sim: ITL p99 disaggregated / idle: 2.00",
        "sim: short-prompt throughput disaggregated / colocated: 1.10",
    ]
    assert output_differences(["a", "b"], ["a", "b"]) == 0
    assert output_differences(["a", "b"], ["a", "c"]) == 1
    assert output_differences(["a", "b"], ["a"]) == 1


@pytest.mark.e2e
def test_quick_run_prints_lines_that_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], smollm2_dir: Path
) -> None:
    out = tmp_path / "pd.json"
    main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    assert re.search(r"^CPU model: \S.*, \d+ cores$", printed, re.M)
    for part in ("cpu", "sim"):
        for mode in ("colocated", "disaggregated"):
            row = rf"^{part} +{mode} +(\d+\.\d+ +){{8}}(\d+)/0/0$"
            assert re.search(row, printed, re.M), (part, mode)
        ratios = re.findall(
            rf"^{part}: (ITL p99 ratio colocated / disaggregated|ITL p99 disaggregated / idle|"
            rf"short-prompt throughput disaggregated / colocated): \d+\.\d\d$",
            printed,
            re.M,
        )
        assert len(ratios) == 3, part
    assert re.search(r"^KV transfer / loopback: \d+\.\d\d$", printed, re.M)
    assert re.search(r"^KV transfer path alone / loopback: \d+\.\d\d ", printed, re.M)
    differences = re.search(r"^output differences: (\d+)$", printed, re.M)
    assert differences and int(differences.group(1)) == 0
    report = json.loads(out.read_text())
    assert report["output_differences"] == 0
    assert report["command"] == "python -m bench.pd --quick --out " + str(out)
    assert set(report["modes"]) == {"cpu", "sim"}
    for part, modes in report["modes"].items():
        assert set(modes) == {"colocated", "disaggregated"}
        handed = modes["disaggregated"]["handoffs"]
        assert handed["transferred"] == len(report["workloads"][part]["long_tokens"])
        assert modes["colocated"]["handoffs"]["transferred"] == 0
        assert all(modes["colocated"]["long_completion_tokens"])
    kv = report["kv_transfer"]
    assert kv["bytes"] > 0 and kv["loopback_bytes_per_s"] > 0 and kv["handoffs"] == 2
