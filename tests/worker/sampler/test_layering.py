"""The sampler consumes SamplingMetadata only: it imports nothing of the worker outside its
own package (the worker builds the metadata from its persistent batch), so no cycle returns."""

from __future__ import annotations

import ast
from pathlib import Path

import services.worker.sampler

SAMPLER_DIR = Path(services.worker.sampler.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (TYPE_CHECKING blocks and functions too)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            modules.add(node.module or "")
    return modules


def test_sampler_imports_nothing_of_the_worker_outside_itself():
    files = sorted(SAMPLER_DIR.glob("*.py"))
    assert len(files) > 5
    outside = {
        f"{path.name}: {module}"
        for path in files
        for module in imported_modules(path)
        if module.startswith("services") and not module.startswith("services.worker.sampler")
    }
    assert not outside
