"""Fixtures of the gateway tests: the real tokenizer of the default model, a scripted engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.tokenizer import Tokenizer
from tests.gateway.fakes import FakeEngine, make_client


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
async def client(engine: FakeEngine, tokenizer: Tokenizer):
    async with make_client(engine, tokenizer) as c:
        yield c
