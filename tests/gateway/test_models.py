"""Several models behind one gateway: a request's `model` picks the model's engine (or a LoRA
adapter one of them serves), /v1/models lists them all, /health and the metrics per model;
against two scripted engines."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.gateway.fakes import MAX_MODEL_LEN, MODEL, C, FakeEngine, gateway_config

pytestmark = pytest.mark.anyio

OTHER = "tiny-chat"
OTHER_LEN = 64


def _extra(model_dir) -> str:
    return json.dumps(
        [
            {
                "name": OTHER,
                "model_dir": str(model_dir),
                "subject_prefix": "skiff.models.tiny",
                "max_model_len": OTHER_LEN,
            }
        ]
    )


@pytest.fixture
def other(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer, text="A different model.")


@pytest.fixture
async def app(engine, other, tokenizer, smollm2_dir):
    config = gateway_config(extra_models=_extra(smollm2_dir))
    return create_app(engine, tokenizer, config, extra=[(other, tokenizer)])


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


async def _complete(client, model: str | None) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 50, **({"model": model} if model else {})}
    return await client.post(C, json=body)


async def test_a_request_goes_to_the_engine_of_the_model_it_names(client, engine, other):
    r = await _complete(client, OTHER)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == OTHER
    assert r.json()["choices"][0]["text"] == "A different model."
    assert len(other.submitted) == 1 and not engine.submitted
    r = await _complete(client, MODEL)
    assert r.json()["choices"][0]["text"] == "Hello world, how are you?"
    assert len(engine.submitted) == 1
    r = await _complete(client, None)  # no model: the first
    assert r.json()["model"] == MODEL and len(engine.submitted) == 2
    r = await _complete(client, "gpt-4")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"] == "The model `gpt-4` does not exist."
    assert r.json()["error"]["param"] == "model"


async def test_an_adapter_runs_on_the_model_that_serves_it(client, engine, other):
    other.lora_adapters["sql"] = "/adapters/sql"
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert other.submitted[-1].lora_name == "sql" and not engine.submitted


async def test_each_model_has_its_own_context_length(client, other):
    r = await client.post(C, json={"model": OTHER, "prompt": "hi " * 100, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert str(OTHER_LEN) in r.json()["error"]["message"] and not other.submitted
    r = await _complete(client, MODEL)
    assert r.status_code == 200
    r = await client.post("/tokenize", json={"model": OTHER, "prompt": "hi"})
    assert r.json()["max_model_len"] == OTHER_LEN
    r = await client.post("/tokenize", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404


async def test_models_lists_every_model_and_its_adapters(client, engine, other, smollm2_dir):
    other.lora_adapters["sql"] = "/adapters/sql"
    data = (await client.get("/v1/models")).json()["data"]
    cards = [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in data]
    assert cards == [
        (MODEL, str(smollm2_dir), None, MAX_MODEL_LEN),
        (OTHER, str(smollm2_dir), None, OTHER_LEN),
        ("sql", "/adapters/sql", OTHER, OTHER_LEN),
    ]


async def test_health_and_metrics_per_model(client, app, engine, other):
    other.ready = False
    assert (await client.get("/health")).status_code == 200  # one model is enough
    assert (await client.get("/health", params={"model": OTHER})).status_code == 503
    assert (await client.get("/health", params={"model": MODEL})).status_code == 200
    assert (await client.get("/health", params={"model": "nope"})).status_code == 404
    engine.ready = False
    assert (await client.get("/health")).status_code == 503
    engine.ready = other.ready = True
    await _complete(client, OTHER)
    value = app.state.models.default.metrics.registry.get_sample_value
    assert (
        value("vllm:request_success_total", {"model_name": OTHER, "finished_reason": "stop"}) == 1
    )
    assert (
        value("vllm:request_success_total", {"model_name": MODEL, "finished_reason": "stop"})
        is None
    )
    assert value("vllm:e2e_request_latency_seconds_count", {"model_name": MODEL}) == 0
    assert value("skiff_gateway_engine_ready", {"model_name": OTHER}) == 1
    app.state.models.draining = True
    assert (await _complete(client, OTHER)).status_code == 503
    assert (await _complete(client, MODEL)).status_code == 503
    assert (await client.get("/health")).status_code == 503


async def test_adapters_load_on_the_model_the_body_names(client, engine, other):
    body = {"lora_name": "sql", "lora_path": "sql", "model": OTHER}
    assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
    assert other.lora_adapters == {"sql": "sql"} and not engine.lora_adapters
    r = await client.post("/v1/load_lora_adapter", json={**body, "model": MODEL})
    assert r.status_code == 409 and OTHER in r.json()["error"]["message"]
    r = await client.post("/v1/load_lora_adapter", json={**body, "lora_name": OTHER})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = await client.post("/v1/load_lora_adapter", json={**body, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b"})
    assert r.status_code == 200 and engine.lora_adapters == {"b": "b"}  # default: the first
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200 and not other.lora_adapters
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404


def test_extra_models_are_checked(smollm2_dir, engine, tokenizer):
    good = json.loads(_extra(smollm2_dir))[0]
    for bad, match in (
        ([{**good, "name": MODEL}], "same name"),
        ([{**good, "subject_prefix": "skiff"}], "same subject_prefix"),
        ([{**good, "subject_prefix": "a b"}], "invalid NATS subject prefix"),
        ([{**good, "scheduler_shards": 0}], "must be >= 1"),
        ([{**good, "colour": "red"}], "unknown field"),
        ([{"name": "x"}], "missing required field"),
    ):
        with pytest.raises(ValueError, match=match):
            gateway_config(extra_models=json.dumps(bad))
    with pytest.raises(ValueError, match="1 extra models need as many engines"):
        create_app(engine, tokenizer, gateway_config(extra_models=json.dumps([good])))
    config = GatewayConfig(extra_models=json.dumps([good]))
    only = config.for_model(config.models[1])
    assert (only.served_model_name, only.subject_prefix, only.max_model_len) == (
        OTHER,
        "skiff.models.tiny",
        OTHER_LEN,
    )
    assert only.models == [config.models[1]]
