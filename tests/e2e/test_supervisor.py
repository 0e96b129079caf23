"""`skiff serve` supervises its processes: the real CLI as a subprocess with simulated workers,
streams through the official `openai` client. A SIGKILLed process (the workers' process, the
scheduler, the gateway, nats-server) is restarted with a growing delay while every stream on
the rest completes, and SIGINT drains the gateway's streams before anything else stops.

The `Supervisor` itself is tested first on short-lived real processes with short delays.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from services.launcher import free_port
from services.supervisor import Backoff, Supervisor

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 100  # at 20 ms a step, a stream lasts about 2 s
NUM_STREAMS = 6
ROOT = Path(__file__).resolve().parents[2]

# ---- the Supervisor on its own -------------------------------------------------------------


def supervise(argv: list[str], backoff: Backoff) -> tuple[list[str], Supervisor]:
    """A `Supervisor` of one process running `argv`; returns what it says and itself."""
    procs = {"child": subprocess.Popen(argv)}
    said: list[str] = []

    def restart(name: str) -> None:
        procs[name] = subprocess.Popen(argv)

    supervisor = Supervisor(procs, restart, said.append, backoff, poll_interval=0.01)
    supervisor.start()
    return said, supervisor


def delays(said: list[str]) -> list[float]:
    return [float(m[1]) for line in said if (m := re.search(r"restarting in ([\d.]+) s", line))]


def test_backoff_doubles_up_to_its_maximum():
    backoff = Backoff(initial_delay=0.5, max_delay=30.0)
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_a_crash_loop_backs_off_and_is_reported():
    said, supervisor = supervise(
        [sys.executable, "-c", "raise SystemExit(3)"], Backoff(0.05, 0.2, stable_period=60.0)
    )
    deadline = time.monotonic() + 30
    while len(delays(said)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.retire("child")
    supervisor.stop()
    assert delays(said)[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
    exits = [line for line in said if "exited with code 3" in line]
    assert ["crash loop" in line for line in exits[:4]] == [False, False, True, True]
    assert "restarted (pid " in said[1]


def test_a_process_that_ran_a_stable_period_starts_over():
    said, supervisor = supervise(["sleep", "0.3"], Backoff(0.05, 0.2, stable_period=0.2))
    deadline = time.monotonic() + 30
    while len(delays(said)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.retire("child")
    supervisor.stop()
    assert delays(said)[:3] == [0.05, 0.05, 0.05]
    assert not any("crash loop" in line for line in said)


# ---- `skiff serve` -------------------------------------------------------------------------


class Serve:
    """A running `skiff serve`: its output, read line by line as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str], url: str, log_dir: Path) -> None:
        self.url, self.log_dir = url, log_dir
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.nats_url = self.wait_for(r"starting nats-server on (\S+)", 60)[1]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float, since: int = 0) -> re.Match[str]:
        """The first line from `since` on that matches `pattern`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if m := re.search(pattern, line):
                    return m
            assert self.proc.poll() is None or self._reader.is_alive(), self.output
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n{self.output}")

    def pid(self, name: str) -> int:
        """The pid of the latest start of process `name`."""
        pids = re.findall(rf"\b{re.escape(name)} (?:\w+ )?\(pid (\d+)\)", self.output)
        return int(pids[-1])

    def workers_adopted(self) -> list[int]:
        """How many times the scheduler (any start of it) took up each worker."""
        log = (self.log_dir / "scheduler.log").read_text(errors="replace")
        return [log.count(f"worker worker-{i} ready") for i in range(2)]


@pytest.fixture(scope="module")
def serve(smollm2_dir, tmp_path_factory) -> Iterator[Serve]:
    cache = tmp_path_factory.mktemp("supervised")  # the logs go to <cache>/logs
    port = free_port()
    argv = [
        *(sys.executable, "-m", "services.cli", "serve", "--model", str(smollm2_dir)),
        *("--served-model-name", MODEL, "--port", str(port)),
        *("--worker-device", "sim", "--workers", "2", "--sim-step-base-ms", "20"),
    ]
    # no fixed metrics port: other stacks may run side by side
    env = {**os.environ, "SKIFF_CACHE_DIR": str(cache), "SKIFF_SCHEDULER_METRICS_PORT": "0"}
    s = Serve(argv, env, f"http://127.0.0.1:{port}", cache / "logs")
    s.wait_for("skiff is serving", 120)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGINT)
        try:
            s.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            raise


@pytest.fixture(scope="module")
def client(serve) -> OpenAI:
    return OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120)


def request(seed: int) -> dict:
    return dict(
        model=MODEL,
        prompt=f"stream {seed}",
        max_tokens=MAX_TOKENS,
        seed=seed,
        extra_body={"ignore_eos": True},
    )


@pytest.fixture(scope="module")
def expected(client) -> list[str]:
    """What each stream gives undisturbed (seeded simulated tokens)."""
    return [client.completions.create(**request(i)).choices[0].text for i in range(NUM_STREAMS)]


def stream_through(client: OpenAI, disrupt) -> list[tuple[str, str | None]]:
    """Stream NUM_STREAMS requests; `disrupt()` runs once each has had a few chunks. Returns
    each stream's text and finish reason."""
    results: list[tuple[str, str | None]] = [("", None)] * NUM_STREAMS
    started = threading.Barrier(NUM_STREAMS + 1)

    def consume(i: int) -> None:
        text, finish = "", None
        for n, chunk in enumerate(client.completions.create(**request(i), stream=True)):
            if n == 5:
                started.wait(timeout=60)
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        results[i] = (text, finish)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    disrupt()
    for t in threads:
        t.join(timeout=120)
    return results


def kill(serve: Serve, name: str) -> tuple[int, int]:
    """SIGKILL process `name`; returns the old pid and where its restart shows up."""
    pid, since = serve.pid(name), len(serve.lines)
    os.kill(pid, signal.SIGKILL)
    return pid, since


def wait_healthy(serve: Serve, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{serve.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not healthy within {timeout_s} s:\n{serve.output}")


@pytest.mark.parametrize("name", ["sim-workers", "scheduler"])
def test_a_killed_backend_process_is_restarted_and_every_stream_completes(
    serve, client, expected, name
):
    adopted = serve.workers_adopted()
    killed: list[tuple[int, int]] = []
    results = stream_through(client, lambda: killed.append(kill(serve, name)))
    assert results == [(text, "length") for text in expected]
    (old_pid, since), new = killed[0], serve.wait_for(rf"{name} restarted \(pid (\d+)\)", 60)
    assert int(new[1]) != old_pid
    serve.wait_for(rf"{name} exited with code -9; restarting in [\d.]+ s", 1, since)
    deadline = time.monotonic() + 30  # the scheduler drives both workers again
    while not all(
        now > before for now, before in zip(serve.workers_adopted(), adopted, strict=True)
    ):
        assert time.monotonic() < deadline, serve.workers_adopted()
        time.sleep(0.2)


@pytest.mark.parametrize("name", ["gateway", "nats"])
def test_a_killed_gateway_or_nats_server_is_restarted(serve, client, expected, name):
    old_pid, since = kill(serve, name)
    new = serve.wait_for(rf"{name} restarted \(pid (\d+)\)", 60, since)
    assert int(new[1]) != old_pid
    wait_healthy(serve)
    assert client.completions.create(**request(0)).choices[0].text == expected[0]


def test_repeated_crashes_back_off(serve, client, expected):
    first = len(serve.lines)
    for _ in range(3):
        _, since = kill(serve, "sim-workers")
        serve.wait_for(r"sim-workers restarted", 60, since)
    said = [line for line in serve.lines[first:] if "sim-workers exited" in line]
    waits = delays(said)
    assert len(waits) == 3 and waits[1] == 2 * waits[0] and waits[2] == 2 * waits[1], said
    assert "crash loop" in said[-1]
    wait_healthy(serve)
    assert client.completions.create(**request(1)).choices[0].text == expected[1]


def test_sigint_drains_streams_then_exits_0(serve, client, expected):
    """Last: it stops the stack. New requests are refused once the drain began, the streams
    in flight finish on a backend that is still up, and nothing prints a traceback."""
    refused: list[BaseException] = []

    def interrupt() -> None:
        since = len(serve.lines)
        serve.proc.send_signal(signal.SIGINT)
        serve.wait_for("skiff: stopping", 10, since)
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            try:
                client.completions.create(**request(0), timeout=5)
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                refused.append(exc)
            time.sleep(0.05)

    start = time.monotonic()
    results = stream_through(client, interrupt)
    assert results == [(text, "length") for text in expected]
    assert refused, "the draining gateway still accepted new requests"
    assert serve.proc.wait(timeout=60) == 0
    assert time.monotonic() - start < 60
    serve.wait_for("skiff: stopped", 5)
    assert "Traceback" not in serve.output
    for log in sorted(serve.log_dir.glob("*.log")):
        assert "Traceback" not in log.read_text(errors="replace"), log.name
