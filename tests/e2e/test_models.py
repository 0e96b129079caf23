"""Two models behind one gateway, as a user runs them: `skiff serve --extra-models` (NATS with
per-user permissions and TLS, as by default) serving the embedded SmolLM2 and a tiny random
Llama the test creates (with SmolLM2's tokenizer files), each on its own scheduler and worker.
The official `openai` client; greedy output of each model equals transformers on that model's
weights; a model that does not exist is a 404; the gateway's metrics are per model."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers
from openai import NotFoundError, OpenAI

from services.launcher import free_port
from shared.tokenizer import Tokenizer
from tests.conftest import make_tiny_model

MODEL, TINY = "SmolLM2-135M-Instruct", "tiny-chat"
MAX_MODEL_LEN = 1024
NEW_TOKENS = 10
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A random Llama over SmolLM2's vocabulary, with its tokenizer files."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("models") / TINY,
        "LlamaForCausalLM",
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """`skiff serve` with the tiny model as an extra model; its URL once it says it serves."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    argv = [
        sys.executable, "-m", "services.cli", "serve", "--port", str(port),
        "--extra-models", f"{TINY}={tiny_dir}", "--kv-cache-gib", "0.25",
        "--max-model-len", str(MAX_MODEL_LEN), "--scheduler-metrics-port", "0",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "skiff is serving" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=300)


def expected(model_dir: Path, prompt: str) -> str:
    """transformers' greedy continuation (fp32)."""
    tokenizer = Tokenizer(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.decode(ids[-NEW_TOKENS:])


def complete(client: OpenAI, model: str) -> str:
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.model == model
    return response.choices[0].text


def test_models_lists_both(client, smollm2_dir, tiny_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, TINY]
    tiny = models[1].model_dump()
    assert tiny["root"] == str(tiny_dir) and tiny["parent"] is None
    assert tiny["max_model_len"] == MAX_MODEL_LEN


def test_each_model_answers_greedily_as_transformers(client, smollm2_dir, tiny_dir):
    want = {MODEL: expected(smollm2_dir, PROMPT), TINY: expected(tiny_dir, PROMPT)}
    assert want[MODEL] != want[TINY]
    assert {name: complete(client, name) for name in want} == want


def test_chat_on_the_extra_model_and_an_unknown_model(client):
    response = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert response.model == TINY and response.usage.completion_tokens >= 1
    with pytest.raises(NotFoundError, match=r"The model `gpt-4` does not exist\."):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def test_the_gateway_metrics_are_per_model(client, served):
    for model in (MODEL, TINY):
        complete(client, model)
    with urllib.request.urlopen(f"{served}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for model in (MODEL, TINY):
        assert f'skiff_gateway_engine_ready{{model_name="{model}"}} 1.0' in text
        labels = f'finished_reason="length",model_name="{model}"'
        assert f"vllm:request_success_total{{{labels}}}" in text
