"""Restoring runtime-loaded LoRA adapters on a restarted scheduler: which were lost, retries
while no worker can check them, an adapter another gateway restored first, a refusal, and
the deadline. The real restart: tests/e2e/test_lora.py."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import adapter_restore
from services.gateway.adapter_restore import lost_adapters, restore_adapters
from services.gateway.request_stream import EngineError
from shared.wire import LoRAAdapterChange, LoRAAdapterReply

NO_WORKER = LoRAAdapterReply(ok=False, status=503, message="no worker is ready to check it")


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(adapter_restore, "FIRST_RETRY_S", 0.01)
    monkeypatch.setattr(adapter_restore, "LAST_RETRY_S", 0.02)


class Scheduler:
    """Answers each load from a script of replies per adapter; records what it was asked."""

    def __init__(self, replies: dict[str, list[LoRAAdapterReply | EngineError]]) -> None:
        self.replies = replies
        self.asked: list[LoRAAdapterChange] = []

    async def change_lora(self, change: LoRAAdapterChange) -> LoRAAdapterReply:
        self.asked.append(change)
        script = self.replies[change.lora_name]
        reply = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(reply, EngineError):
            raise reply
        return reply


def test_the_lost_adapters_are_those_the_new_epoch_lacks():
    before = {"sql": "/a/sql", "chat": "/a/chat", "poet": "/a/poet"}
    assert lost_adapters(before, {"sql": "/a/sql"}) == {"chat": "/a/chat", "poet": "/a/poet"}
    assert lost_adapters(before, before) == {}


def test_loads_are_retried_until_a_worker_can_check_them():
    ok = LoRAAdapterReply(ok=True, lora_path="/a/chat")
    unreachable = EngineError(503, "no scheduler is listening")
    scheduler = Scheduler({"chat": [NO_WORKER, unreachable, ok]})
    failed = asyncio.run(restore_adapters(scheduler.change_lora, {"chat": "/a/chat"}, shard="p"))
    assert failed == {}
    assert [(c.lora_name, c.lora_path, c.load) for c in scheduler.asked] == [
        ("chat", "/a/chat", True)
    ] * 3


def test_an_adapter_another_gateway_restored_first_counts_and_a_refusal_is_reported():
    scheduler = Scheduler(
        {
            "chat": [
                LoRAAdapterReply(
                    ok=False, status=400, message="The lora adapter 'chat' has already been loaded."
                )
            ],
            "gone": [LoRAAdapterReply(ok=False, status=400, message="no adapter_config.json")],
        }
    )
    lost = {"chat": "/a/chat", "gone": "/a/gone"}
    failed = asyncio.run(restore_adapters(scheduler.change_lora, lost, shard="p"))
    assert failed == {"gone": "/a/gone"}
    assert len(scheduler.asked) == 2  # neither is asked again


def test_still_unavailable_at_the_deadline_is_given_up():
    scheduler = Scheduler({"chat": [NO_WORKER]})
    failed = asyncio.run(
        restore_adapters(scheduler.change_lora, {"chat": "/a/chat"}, shard="p", deadline_s=0.1)
    )
    assert failed == {"chat": "/a/chat"}
    assert 2 <= len(scheduler.asked) <= 12
