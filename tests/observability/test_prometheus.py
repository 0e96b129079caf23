"""A real Prometheus (Debian's, see install_prometheus.py) scrapes the shared session stack
(gateway, scheduler and its real CPU worker) every second with the alert rules loaded; after
traffic from the openai client, every expression of every dashboard panel and every alert's
value returns data (a finite sample) through Prometheus' HTTP API."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from services.launcher import Stack, free_port
from tests.observability.tools import CHART, binary, load_generator

RULES = CHART / "alerts" / "skiff.rules.yaml"
# Grafana's variables, as "All" and a rate window that spans the traffic
VARIABLES = {"$__rate_interval": "2m", "$model_name": ".*", "$worker_id": ".*"}


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10)

    def api(self, path: str, **params: str) -> dict:
        reply = self.http.get(f"/api/v1/{path}", params=params)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]


def scrape_config(stack: Stack) -> dict:
    c, host = stack.config, "127.0.0.1"
    assert c.scheduler_metrics_port and c.worker_http_port, "the session stack serves /metrics"
    workers = [f"{host}:{c.worker_http_port + i}" for i in range(c.workers)]
    jobs = {
        "skiff-gateway": [stack.url.removeprefix("http://")],
        "skiff-scheduler": [f"{host}:{c.scheduler_metrics_port}"],
        "skiff-worker": workers,  # the job name the rules' worker alerts select
    }
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }


@pytest.fixture(scope="session")
def prometheus(stack, tmp_path_factory) -> Iterator[Prometheus]:
    """Prometheus on a generated scrape config, once every target is up."""
    root: Path = tmp_path_factory.mktemp("prometheus")
    (root / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(stack)))
    port = free_port()
    log = (root / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        targets: list[dict] = []
        while True:
            assert proc.poll() is None, (root / "prometheus.log").read_text()[-3000:]
            try:
                # 503 "Service Unavailable" until its storage is open
                if prom.http.get("/-/ready").status_code != 200:
                    raise httpx.HTTPError("not ready")
                targets = prom.api("targets")["activeTargets"]
                if len(targets) == 3 and all(t["health"] == "up" for t in targets):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"targets not up: {targets}"
            time.sleep(0.5)
        yield prom
    finally:
        prom.http.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="session")
def traffic(prometheus, openai_client, stack) -> None:
    """Real requests: chat and completions, streamed and not, a stop string, a client that
    sends a bad request; then two scrapes' time so that Prometheus has them."""
    model = stack.config.served_model_name
    time.sleep(2)  # samples before the traffic: rates have a start
    for i in range(3):
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=8
        )
        stream = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            stream=True,
        )
        assert sum(1 for _ in stream) > 1
    openai_client.completions.create(model=model, prompt="The sky is", max_tokens=6, stop=[" "])
    with pytest.raises(Exception):  # noqa: B017 - any 4xx from the openai client
        openai_client.completions.create(model=model, prompt="x", max_tokens=-1)
    time.sleep(3)


def dashboard_expressions() -> list[tuple[str, str]]:
    generator = load_generator("dashboards/generate.py")
    return [(b.file, e) for make in generator.BOARDS for b in [make()] for e in b.expressions()]


def alert_values() -> list[tuple[str, str]]:
    generator = load_generator("alerts/generate.py")
    return [(a.name, c.value.replace(generator.WORKER_JOB, "skiff-worker"))
            for a in generator.ALERTS for c in a.conditions]  # fmt: skip


def grafana(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_every_target_is_scraped_including_the_real_worker(prometheus, traffic):
    up = {r["metric"]["job"]: r["value"][1] for r in prometheus.query("up")}
    assert up == {"skiff-gateway": "1", "skiff-scheduler": "1", "skiff-worker": "1"}
    assert prometheus.query('{__name__=~"vllm_.+"}') == []  # vLLM's names keep their colon
    devices = prometheus.query("skiff_worker_device_memory_bytes")
    assert {r["metric"]["kind"] for r in devices} == {"kv_cache"}  # the CPU worker's tensors
    phases = prometheus.query("sum by (phase) (skiff_worker_step_phase_seconds_count)")
    counts = {r["metric"]["phase"]: float(r["value"][1]) for r in phases}
    assert set(counts) == {"prepare", "forward", "sample", "write_back"}
    assert min(counts.values()) > 0 and len(set(counts.values())) == 1  # every step, each phase


# Series the shared stack (one mixed worker) cannot produce, and the test that checks them.
NEEDS_ANOTHER_STACK = {
    "skiff_pd_transfer_seconds_bucket": "hand-overs need a prefill worker: "
    "tests/e2e/test_disaggregation.py reads this histogram",
    "skiff_lora_requests": "adapters need a stack serving some: tests/e2e/test_lora.py",
    "skiff_worker_lora_": "adapter slots need a worker with --enable-lora: "
    "tests/worker/test_lora.py reads these series",
}


@pytest.mark.parametrize(("board", "expr"), dashboard_expressions())
def test_dashboard_panel_returns_data(prometheus, traffic, board, expr):
    result = prometheus.query(grafana(expr))
    if any(series in expr for series in NEEDS_ANOTHER_STACK):
        assert result == [] or not has_data(result), f"{board}: now has data, drop the exception"
        return
    assert has_data(result), f"{board}: no data for {expr}"


@pytest.mark.parametrize(("alert", "expr"), alert_values())
def test_alert_value_returns_data(prometheus, traffic, alert, expr):
    assert has_data(prometheus.query(expr)), f"{alert}: no data for {expr}"


def test_alert_rules_load_and_evaluate(prometheus, traffic):
    """Prometheus loaded every rule and evaluates them without error; none fires on a healthy
    stack (SkiffSchedulerRestarted included: one scheduler epoch all along)."""
    (group,) = prometheus.api("rules")["groups"]
    names = {a.name for a in load_generator("alerts/generate.py").ALERTS}
    assert {r["name"] for r in group["rules"]} == names
    assert all(r["health"] == "ok" for r in group["rules"]), group["rules"]
    assert [r for r in group["rules"] if r["state"] == "firing"] == []
