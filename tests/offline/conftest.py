from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tiny_models, tmp_path_factory):
    """The tiny random Llama (conftest `tiny_models`: vocab 211, EOS 1) with a word-level
    tokenizer ("t5" is id 5)."""
    from tokenizers import Tokenizer, models

    path = tmp_path_factory.mktemp("sampler") / "llama"
    shutil.copytree(tiny_models["llama"], path)
    vocab = {f"t{i}": i for i in range(211)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path
