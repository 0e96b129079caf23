"""LoRA adapters at the gateway: the model a request names, /v1/models, and vLLM's load and
unload endpoints (admin routes), against the scripted engine."""

from __future__ import annotations

import pytest

from tests.gateway.fakes import MODEL, C
from tests.gateway.test_tenants import auth, key_file, make

pytestmark = pytest.mark.anyio


async def test_a_request_names_a_served_adapter_as_its_model(client, engine):
    engine.lora_adapters["sql"] = "/adapters/sql"
    r = await client.post(C, json={"model": "sql", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert engine.submitted[-1].lora_name == "sql"
    r = await client.post(C, json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.json()["model"] == MODEL and engine.submitted[-1].lora_name is None
    r = await client.post(C, json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_models_lists_the_adapters_under_the_base_model(client, engine):
    engine.lora_adapters.update({"b": "/adapters/b", "a": "/adapters/a"})
    data = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data][1:] == [
        ("a", "/adapters/a", MODEL),
        ("b", "/adapters/b", MODEL),
    ]
    assert data[0]["id"] == MODEL and data[0]["parent"] is None
    assert all(m["max_model_len"] == data[0]["max_model_len"] for m in data)


async def test_load_and_unload_in_vllm_shapes(client, engine):
    body = {"lora_name": "sql", "lora_path": "sql"}
    r = await client.post("/v1/load_lora_adapter", json=body)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert engine.lora_adapters == {"sql": "sql"}
    r = await client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "x"})
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400  # no path
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    r = await client.post(C, json={"model": "sql", "prompt": "hi"})
    assert r.status_code == 404


async def test_adapter_endpoints_need_an_admin_key_and_adapters_obey_allow_lists(
    engine, tokenizer, tmp_path
):
    path = key_file(tmp_path, a={"models": [MODEL, "sql"]}, ops={"admin": True})
    _, client, _ = make(engine, tokenizer, path)
    body = {"lora_name": "sql", "lora_path": "sql"}
    async with client:
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 401
        r = await client.post("/v1/load_lora_adapter", json=body, headers=auth("a"))
        assert r.status_code == 403 and not engine.lora_adapters
        r = await client.post("/v1/load_lora_adapter", json=body, headers=auth("ops"))
        assert r.status_code == 200
        engine.lora_adapters["other"] = "other"
        ids = [m["id"] for m in (await client.get("/v1/models", headers=auth("a"))).json()["data"]]
        assert ids == [MODEL, "sql"]  # a may not use "other"
        r = await client.post(C, json={"model": "other", "prompt": "hi"}, headers=auth("a"))
        assert r.status_code == 403
        r = await client.post(
            C, json={"model": "sql", "prompt": "hi", "max_tokens": 2}, headers=auth("a")
        )
        assert r.status_code == 200
