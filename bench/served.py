"""The reference workload end to end: HTTP -> gateway -> NATS -> scheduler -> worker.

All requests are streamed at once; the client records time to first token and the gaps between
tokens. The scheduler's Prometheus histograms give the per-step breakdown: plan-to-result round
trip, the worker's own time per step, and the scheduler's CPU time per step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
import urllib.request

import httpx

from services.launcher import Stack, StackConfig, free_port
from shared.config import SchedulerServiceConfig


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(values)}


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int):
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            is_data = line.startswith("data: ") and line != "data: [DONE]"
            if is_data and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return start, stamps


def _histogram_means(metrics_url: str) -> dict[str, float]:
    """Mean of each skiff_* histogram (sum / count) from a Prometheus text page."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("skiff_") or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name.endswith("_sum"):
            sums[name[:-4]] = sums.get(name[:-4], 0.0) + float(value)
        elif name.endswith("_count"):
            counts[name[:-6]] = counts.get(name[:-6], 0.0) + float(value)
    return {k: sums[k] / counts[k] for k in sums if counts.get(k)}


def run_served(model_dir: str, prompts: list[list[int]], outputs: list[int]) -> dict:
    metrics_port = free_port()
    stack = Stack(
        StackConfig(
            model_dir=model_dir,
            served_model_name="bench",
            port=free_port(),
            scheduler_service=SchedulerServiceConfig(metrics_port=metrics_port),
            log_dir="/tmp/skiff-bench",
        )
    )
    stack.start()
    try:

        async def run():
            async with httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=256)
            ) as client:
                await _stream(client, stack.url, prompts[0], 4)  # warm-up
                t0 = time.perf_counter()
                results = await asyncio.gather(
                    *(
                        _stream(client, stack.url, p, n)
                        for p, n in zip(prompts, outputs, strict=True)
                    )
                )
                return time.perf_counter() - t0, results

        elapsed, results = asyncio.run(run())
        ttft = [stamps[0] - start for start, stamps in results if stamps]
        itl = [b - a for _, stamps in results for a, b in itertools.pairwise(stamps)]
        steps = _histogram_means(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stack.stop()
    round_trip = steps.get("skiff_step_round_trip_seconds", 0.0)
    execute = steps.get("skiff_worker_execute_seconds", 0.0)
    return {
        "tokens_per_s": sum(outputs) / elapsed,
        "elapsed_s": elapsed,
        "ttft_s": _percentiles(ttft),
        "itl_s": _percentiles(itl),
        "per_step_mean_s": {
            "round_trip (plan published -> result received)": round_trip,
            "worker execute (inputs + forward + sampling)": execute,
            "nats + encode/decode (round trip - execute)": round_trip - execute,
            "scheduler CPU (schedule + update + publish)": steps.get("skiff_schedule_seconds", 0.0),
            "plan size (bytes)": steps.get("skiff_plan_bytes", 0.0),
        },
    }
