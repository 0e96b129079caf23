"""The benchmark plots on small synthetic data: real PNG files of the expected size."""

from __future__ import annotations

import struct

from bench.plots import cdf, plot_latency_cdfs, plot_throughput
from bench.served import plot_served


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_cdf_is_sorted_and_ends_at_one():
    assert cdf([0.3, 0.1, 0.2, 0.2]) == ([0.1, 0.2, 0.2, 0.3], [0.25, 0.5, 0.75, 1.0])


def test_throughput_and_latency_plots(tmp_path):
    series = {"skiff": {1: 40.0, 8: 210.0, 32: 480.0}, "transformers": {1: 30.0, 8: 90.0}}
    path = plot_throughput(series, tmp_path / "t.png", "output throughput")
    assert png_size(path) == (840, 540)  # 7 x 4.5 inches at 120 dpi
    ttft = {"1 in flight": [0.05, 0.06, 0.07], "8 in flight": [0.1, 0.2, 0.4]}
    itl = {"1 in flight": [0.01] * 10, "8 in flight": [0.02, 0.03, 0.05], "empty": []}
    path = plot_latency_cdfs(ttft, itl, tmp_path / "l.png", "latency")
    assert png_size(path) == (1320, 540)


def test_served_plots_next_to_the_table(tmp_path):
    summary = {"by_concurrency": {1: {"tokens_per_s": 50.0}, 4: {"tokens_per_s": 160.0}}}
    samples = {1: {"ttft": [0.05, 0.07], "itl": [0.01, 0.02]}, 4: {"ttft": [0.2], "itl": [0.03]}}
    peers = {"transformers generate (static batches)": {1: 30.0, 4: 70.0}}
    paths = plot_served(samples, summary, tmp_path, "cpu", peers)
    assert [p.name for p in paths] == ["cpu-throughput.png", "cpu-latency.png"]
    assert all(png_size(p)[0] > 0 for p in paths)
