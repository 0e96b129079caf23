"""Running a test with one instruction set's C++ CPU kernels (kernels/cpu_ops.py ISAS), or
with one of the bf16 x bf16 kernel's dot-product instruction sets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kernels import cpu_ops


@contextmanager
def _picked(name: str, use: Callable[[str], bool], current: Callable[[], str]) -> Iterator[str]:
    """`use(name)` inside the block, what `current()` said before it after; a CPU without
    `name` skips the test. The ops must build and load."""
    assert cpu_ops.load(), "the C++ CPU ops must build and run on x86-64 with g++ (AVX2 or more)"
    before = current()
    if not use(name):
        pytest.skip(f"this CPU has no {name}")
    try:
        yield name
    finally:
        use(before)


@contextmanager
def running_isa(name: str) -> Iterator[str]:
    """The ops run `name`'s kernels inside the block (the widest again after it)."""
    with _picked(name, cpu_ops.use_isa, cpu_ops.isa) as isa:
        yield isa


@contextmanager
def running_bf16_dot_isa(name: str) -> Iterator[str]:
    """The bf16 x bf16 kernel runs with `name` ("avx512_bf16", "avx512", "avx2") inside the
    block, the other kernels with the instruction set it needs (avx2 for avx2, else avx512)."""
    with (
        _picked(name, cpu_ops.use_bf16_dot_isa, cpu_ops.bf16_dot_isa) as dot_isa,
        running_isa("avx2" if name == "avx2" else "avx512"),
    ):
        yield dot_isa
