"""bench/tls.py: the turn order, pair ratios and report lines, and a tiny run on two real
stacks (TLS on and off) whose lines must parse (not the target: speeds are the machine's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.tls import TlsResult, TlsRun, mean_step, run, turns
from bench.workload import token_prompts
from shared.tokenizer import Tokenizer


def test_turns_alternate_off_on_on_off() -> None:
    assert turns(1) == [False, True, True, False]
    assert turns(2) == [False, True, True, False] * 2


def test_pair_ratios_are_on_over_off_and_the_ratio_their_median() -> None:
    speeds = [100.0, 95.0, 90.0, 100.0, 100.0, 99.0, 120.0, 100.0]
    result = TlsResult(32, 32, [TlsRun(t, s, 1.0) for t, s in zip(turns(2), speeds, strict=True)])
    assert result.pair_ratios() == pytest.approx([0.95, 0.9, 0.99, 1.2])
    assert result.ratio() == pytest.approx(0.97)
    result.cpu_ms_per_token = {"on": {"nats": 0.5, "worker-0": 9.5}, "off": {"worker-0": 9.8}}
    assert result.cpu_ratio() == pytest.approx(0.98)
    assert result.report()[-2:] == [
        "CPU per output token ratio off / on: 0.980",
        "served throughput ratio NATS TLS on / off: 0.97",
    ]
    result.runs[1].tls = False
    with pytest.raises(ValueError, match="once on and once off"):
        result.pair_ratios()


def test_mean_step_in_ms() -> None:
    step = mean_step({"skiff_nats_round_trip_seconds": 0.004, "skiff_plan_bytes": 400.0})
    assert step == {
        "nats round trip ms": pytest.approx(4.0),
        "worker execute ms": 0.0,
        "schedule ms": 0.0,
        "plan bytes": 400.0,
    }


@pytest.mark.e2e
def test_tiny_run_on_two_stacks_reports_every_run(smollm2_dir: Path, tmp_path: Path) -> None:
    prompts = token_prompts(Tokenizer(smollm2_dir), [16, 24])
    result = run(str(smollm2_dir), prompts, [4, 6], rounds=1, log_dir=tmp_path)
    assert [r.tls for r in result.runs] == turns(1)
    assert result.tls_started_first == [False]
    assert all(r.tokens_per_s > 0 for r in result.runs)
    assert set(result.steps) == set(result.cpu_ms_per_token) == {"on", "off"}
    assert set(result.cpu_ms_per_token["on"]) == {"nats", "scheduler", "worker-0", "gateway"}
    # CPU time counts in 10 ms ticks: over a few tokens only the worker surely used some
    assert all(cpu["worker-0"] > 0 for cpu in result.cpu_ms_per_token.values())
    assert all(step["worker execute ms"] > 0 for step in result.steps.values())
    lines = result.report()
    assert sum(bool(re.match(r"^ +\d (tls|plain) +\d+\.\d +\d+\.\d\d$", x)) for x in lines) == 4
    assert sum(x.startswith("CPU ms per output token, NATS TLS ") for x in lines) == 2
    assert re.match(r"^served throughput ratio NATS TLS on / off: \d+\.\d\d$", lines[-1])
