"""Where the embedded default model is read from: the image's converted copy
(`SKIFF_PREBUILT_DIR`, docker/worker.Dockerfile) where it is whole, else the cache folder."""

from __future__ import annotations

import pytest

from shared.default_model import DEFAULT_MODEL_NAME, default_model_dir

pytestmark = pytest.mark.unit


@pytest.fixture
def folders(tmp_path, monkeypatch):
    cache, prebuilt = tmp_path / "cache", tmp_path / "prebuilt"
    monkeypatch.setenv("SKIFF_CACHE_DIR", str(cache))
    monkeypatch.setenv("SKIFF_PREBUILT_DIR", str(prebuilt))
    return cache / "models" / DEFAULT_MODEL_NAME, prebuilt / "models" / DEFAULT_MODEL_NAME


def test_the_image_s_converted_model_is_read_where_it_is_whole(folders):
    in_cache, in_image = folders
    in_image.mkdir(parents=True)
    (in_image / "config.json").write_text("{}")
    assert default_model_dir() == in_cache  # no weights: not whole
    (in_image / "model.safetensors").write_bytes(b"")
    assert default_model_dir() == in_image


def test_without_a_prebuilt_folder_the_model_is_the_cache_folder_s(folders, monkeypatch):
    in_cache, _ = folders
    assert default_model_dir() == in_cache  # the folder is set but holds nothing
    monkeypatch.delenv("SKIFF_PREBUILT_DIR")
    assert default_model_dir() == in_cache
