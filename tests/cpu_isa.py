"""Running a test with one instruction set's C++ CPU kernels (kernels/cpu_ops.py ISAS)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kernels import cpu_ops


@contextmanager
def running_isa(name: str) -> Iterator[str]:
    """The ops run `name`'s kernels inside the block (the widest again after it); a CPU
    without them skips the test. The ops must build and load."""
    assert cpu_ops.load(), "the C++ CPU ops must build and run on x86-64 with g++ (AVX2 or more)"
    widest = cpu_ops.isa()
    if not cpu_ops.use_isa(name):
        pytest.skip(f"this CPU has no {name}")
    try:
        yield name
    finally:
        cpu_ops.use_isa(widest)
