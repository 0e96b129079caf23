"""PNG plots of the benchmarks (matplotlib, `pip install 'skiff[bench]'`): output throughput
against concurrency, one line per system measured, and the CDFs of time to first token and
inter-token latency, one line per run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# system -> {concurrency (requests in flight, a peer's static batch size or llama-server's slot
# count): output tokens/s}
Throughput = Mapping[str, Mapping[int, float]]
# run (e.g. "skiff served, 8 in flight") -> latency samples in seconds
Latencies = Mapping[str, Sequence[float]]


def _figure(figsize: tuple[float, float]) -> Figure:
    """A figure of its own, drawn by the Agg canvas (files only; pyplot is never involved)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def plot_throughput(series: Throughput, path: Path, title: str) -> Path:
    """Output tokens/s against concurrency (log2 axis), one line per system."""
    fig = _figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight; batch peers: batch size; llama-server: slots)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of samples at or below each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_latency_cdfs(ttft: Latencies, itl: Latencies, path: Path, title: str) -> Path:
    """Two panels: the CDF of time to first token and of inter-token latency (ms)."""
    fig = _figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2)
    for ax, samples, label in ((left, ttft, "time to first token"), (right, itl, "inter-token")):
        for name, values in samples.items():
            if values:
                xs, ys = cdf(values)
                ax.step([x * 1e3 for x in xs], ys, where="post", label=name)
        ax.set_xlabel(f"{label} latency, ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
