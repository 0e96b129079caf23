"""The CPU ops an image carries built (docker/worker.Dockerfile, `SKIFF_PREBUILT_DIR`): loaded
as they are when their sources and torch match, so a worker pod compiles nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_prebuilt_library_of_the_same_sources_loads_and_nothing_is_compiled(tmp_path):
    assert cpu_ops.load()
    digest = cpu_ops.build_dir().name
    prebuilt = tmp_path / "prebuilt"
    (prebuilt / "cpu-kernels" / digest).mkdir(parents=True)
    shutil.copy2(cpu_ops.build_dir() / f"{cpu_ops.LIBRARY}.so", prebuilt / "cpu-kernels" / digest)
    cache = tmp_path / "cache"  # a pod's empty cache volume
    env = {**os.environ, "SKIFF_CACHE_DIR": str(cache), "SKIFF_PREBUILT_DIR": str(prebuilt)}
    code = "import torch; from kernels import cpu_ops; assert cpu_ops.load(); print(cpu_ops.isa())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == cpu_ops.isa()  # the ops run
    made = {p.name for p in (cache / "cpu-kernels" / digest).iterdir()}
    assert not {n for n in made if n.endswith((".so", ".o", ".ninja"))}, made  # not compiled


def test_a_prebuilt_library_of_other_sources_is_not_used(tmp_path, monkeypatch):
    other = tmp_path / "cpu-kernels" / "0123456789abcdef"  # another digest
    other.mkdir(parents=True)
    (other / f"{cpu_ops.LIBRARY}.so").write_bytes(b"")
    monkeypatch.setenv("SKIFF_PREBUILT_DIR", str(tmp_path))
    assert cpu_ops.prebuilt_library() is None
    mine = tmp_path / "cpu-kernels" / cpu_ops.build_dir().name
    mine.mkdir()
    (mine / f"{cpu_ops.LIBRARY}.so").write_bytes(b"")
    assert cpu_ops.prebuilt_library() == mine / f"{cpu_ops.LIBRARY}.so"
    monkeypatch.delenv("SKIFF_PREBUILT_DIR")
    assert cpu_ops.prebuilt_library() is None
