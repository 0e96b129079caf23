"""bench/step_phases.py's summary: medians over the decode steps only, and the rate they add
up to."""

from __future__ import annotations

import pytest

from bench.step_phases import summary

pytestmark = pytest.mark.unit


def step(us: float) -> dict[str, float]:
    phases = ("prepare", "forward", "sample", "write_back")
    return {**{p: us / 1e6 for p in phases}, "execute": 4 * us / 1e6, "between": us / 1e6}


def test_summary_skips_the_prefill_and_first_decode_step():
    steps = [step(10_000.0), step(5_000.0), step(100.0), step(200.0), step(300.0)]
    line = summary(steps)
    assert line.startswith("prepare 200 forward 200 sample 200 write_back 200 execute 800")
    assert line.endswith("between 200 us -> 1000.0 tok/s")  # 1e6 / (800 + 200)
