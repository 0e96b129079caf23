"""LoRA adapters served end to end: a real stack (nats-server, scheduler, one CPU worker with
two adapter slots, gateway) on the embedded SmolLM2, random PEFT adapters, the official
`openai` client. Greedy output with an adapter equals transformers with the adapter merged
into the weights, also with base and other adapters' requests in the same batches; adapters
load and unload at run time through vLLM's endpoints, bad ones are refused with the reason;
the scheduler exports vLLM's lora_requests_info."""

from __future__ import annotations

import re
import shutil
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from openai import NotFoundError, OpenAI

from services.launcher import free_port
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig
from shared.config import SchedulerConfig
from shared.tokenizer import Tokenizer
from tests.lora_adapters import ALL_PROJECTIONS, base_model, make_adapters

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SPECS: dict[str, dict[str, Any]] = {
    "sql": {"r": 8, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
    "chat": {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "poet": {"r": 8, "lora_alpha": 32, "target_modules": ["o_proj", "up_proj"]},
    "too-big": {"r": 32, "lora_alpha": 32, "target_modules": ["q_proj"]},
}


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """(the adapters' root, name -> (LoRARequest, transformers merged model)); "base": the
    base model."""
    root = tmp_path_factory.mktemp("adapters")
    base = base_model(smollm2_dir)
    return root, {"base": (None, base), **make_adapters(base, root, SPECS)}


@pytest.fixture(scope="module")
def lora_stack(launch_stack, smollm2_dir, adapters):
    root, _ = adapters
    s = launch_stack(
        "lora",
        runner=RunnerConfig(
            str(smollm2_dir), kv_cache_gib=0.25, enable_lora=True, max_loras=2, max_lora_rank=16
        ),
        scheduler=SchedulerConfig(max_model_len=2048),
        scheduler_service=SchedulerServiceConfig(
            lora_modules=f"sql={root / 'sql'}", lora_root=str(root)
        ),
        scheduler_metrics_port=free_port(),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(lora_stack) -> OpenAI:
    return OpenAI(base_url=f"{lora_stack.url}/v1", api_key="unused", max_retries=0, timeout=300)


def expected(adapters, name: str, prompt: str, tokenizer: Tokenizer) -> str:
    """transformers' greedy continuation with the adapter merged (fp32), EOS included (the
    requests ignore it; its text is empty)."""
    model = adapters[1][name][1]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.decode(ids[-NEW_TOKENS:])


def complete(client: OpenAI, model: str, prompt: str) -> str:
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.model == model
    return response.choices[0].text


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=120)


def test_models_lists_the_adapters_of_the_start(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "sql"}
    sql = models["sql"]
    assert (sql.root, sql.parent) == (str(adapters[0] / "sql"), MODEL)


def test_greedy_with_an_adapter_equals_transformers_merged(client, adapters, smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)
    text = complete(client, "sql", PROMPTS[0])
    assert text == expected(adapters, "sql", PROMPTS[0], tokenizer)
    assert text != complete(client, MODEL, PROMPTS[0])


def test_runtime_load_mixed_batches_and_unload(lora_stack, client, adapters, smollm2_dir):
    """chat and poet loaded at run time; base, sql, chat and poet requests at once (two slots:
    the scheduler holds back what does not fit); each equals its reference; then unloaded."""
    tokenizer = Tokenizer(smollm2_dir)
    for name in ("chat", "poet"):
        r = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
        assert r.status_code == 200, r.text
        assert (r.status_code, r.text) == (
            200,
            f"Success: LoRA adapter '{name}' added successfully.",
        )
    assert {m.id for m in client.models.list().data} == {MODEL, "sql", "chat", "poet"}
    jobs = [(name, p) for name in ("base", "sql", "chat", "poet") for p in PROMPTS[:2]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(
            pool.map(lambda j: complete(client, MODEL if j[0] == "base" else j[0], j[1]), jobs)
        )
    for (name, prompt), text in zip(jobs, texts, strict=True):
        assert text == expected(adapters, name, prompt, tokenizer), (name, prompt)
    for name in ("chat", "poet"):
        r = post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status_code == 200, r.text
    with pytest.raises(NotFoundError, match="chat"):
        complete(client, "chat", PROMPTS[0])
    assert {m.id for m in client.models.list().data} == {MODEL, "sql"}


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (
            {"lora_name": "big", "lora_path": "too-big"},
            400,
            "rank 32 is above this worker's max_lora_rank 16",
        ),
        ({"lora_name": "none", "lora_path": "nowhere"}, 400, "no adapter_config.json"),
        ({"lora_name": "out", "lora_path": "/etc"}, 400, "outside the adapter root"),
        ({"lora_name": "esc", "lora_path": "../x"}, 400, "outside the adapter root"),
        ({"lora_name": "sql", "lora_path": "chat"}, 400, "already been loaded"),
        ({"lora_name": MODEL, "lora_path": "chat"}, 400, "a served model's name"),
    ],
)
def test_bad_loads_are_refused_with_the_reason(lora_stack, client, body, status, reason):
    r = post(lora_stack, "/v1/load_lora_adapter", body)
    assert r.status_code == status and reason in r.json()["error"]["message"], r.text
    assert {m.id for m in client.models.list().data} == {MODEL, "sql"}


def test_a_symlink_out_of_the_adapter_root_is_refused(lora_stack, client, adapters, tmp_path):
    """The path is under the root as a string; the worker follows the symlink out of it."""
    root, _ = adapters
    outside = tmp_path / "outside"
    shutil.copytree(root / "chat", outside)
    (root / "escape").symlink_to(outside)
    r = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "esc", "lora_path": "escape"})
    assert r.status_code == 400, r.text
    assert "leads outside the adapter root" in r.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {MODEL, "sql"}


def test_unknown_adapters_are_404(lora_stack, client):
    with pytest.raises(NotFoundError):
        complete(client, "nope", PROMPTS[0])
    assert post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404


def test_the_scheduler_exports_lora_requests_info(lora_stack, client):
    """While an sql request runs, the gauges count it; once it is done, they read 0 again
    (they follow the scheduler's 0.5 s monitor tick)."""
    url = f"http://127.0.0.1:{lora_stack.config.scheduler_metrics_port}/metrics"

    def sql_running() -> tuple[float, str] | None:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        count = re.search(
            r'^skiff_lora_requests\{adapter="sql",state="running"\} (\S+)$', text, re.M
        )
        info = re.search(
            r'^vllm:lora_requests_info\{max_lora="2",running_lora_adapters="([^"]*)"', text, re.M
        )
        assert count and info, [line for line in text.splitlines() if "lora" in line]
        return float(count.group(1)), info.group(1)

    stream = client.completions.create(
        model="sql", prompt=PROMPTS[1], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    seen = set()
    for i, _chunk in enumerate(stream):
        if i % 10 == 9:
            seen.add(sql_running())
    assert (1.0, "sql") in seen
    deadline = time.monotonic() + 10
    while sql_running() != (0.0, ""):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_restarted_scheduler_serves_the_adapters_loaded_at_run_time(
    lora_stack, client, adapters, smollm2_dir
):
    """The scheduler holds the runtime loads in memory; killed and started again (a new epoch),
    it gets them back from the gateway, and requests naming them are served as before."""
    r = post(lora_stack, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "chat"})
    assert r.status_code == 200, r.text
    reference = expected(adapters, "chat", PROMPTS[0], Tokenizer(smollm2_dir))
    lora_stack.kill("scheduler", signal.SIGKILL)
    lora_stack.start_scheduler()
    lora_stack.wait_ready(120)
    deadline = time.monotonic() + 120
    while "chat" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the adapter was not loaded again"
        time.sleep(0.5)
    assert {m.id for m in client.models.list().data} == {MODEL, "sql", "chat"}
    assert complete(client, "chat", PROMPTS[0]) == reference
    assert post(lora_stack, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
