"""Paths and binaries the observability tests share."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "skiff"


def binary(name: str) -> str:
    """prometheus or promtool: next to this interpreter (install_prometheus.py puts them
    there), else on PATH. Missing, it fails: `make install` provides them."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found: run python tests/observability/install_prometheus.py"
        )
    return found


def load_generator(relative: str) -> ModuleType:
    """A chart generator (charts/skiff/<relative>) as a module."""
    path = CHART / relative
    name = f"skiff_chart_{path.parent.name}_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
