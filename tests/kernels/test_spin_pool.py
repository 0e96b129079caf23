"""The C++ ops' spinning thread pool (kernels/csrc/spin_pool.cpp) through `linear`: the same
bits at every thread count, from several Python threads at once and in a forked child, and
no core burned once the ops go idle."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernels import cpu_ops

pytestmark = pytest.mark.unit

N, K = 4096, 576  # 256 panels: every thread gets a chunk


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_ops.load(), "the C++ CPU ops must build and run on x86-64 with g++ (AVX2 or more)"


@pytest.fixture
def weight() -> torch.Tensor:
    return cpu_ops.pack_panels(torch.randn(N, K, generator=torch.Generator().manual_seed(0)))


def linear(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    return torch.ops.skiff_cpu.linear_packed(x, panels, N, None, None)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_every_thread_count_gives_the_same_bits(weight, threads, rows):
    x = torch.randn(rows, K)
    torch.set_num_threads(1)
    alone = linear(x, weight)
    for count in (2, 3, 4, 1, 2):  # the pool is made again at each change
        torch.set_num_threads(count)
        assert torch.equal(linear(x, weight), alone)


def test_calls_from_several_threads_at_once(weight, threads):
    torch.set_num_threads(2)
    inputs = [torch.randn(4, K, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [linear(x, weight) for x in inputs]
    start = threading.Barrier(4)

    def run(i: int) -> bool:
        if i < 4:  # the first four start together
            start.wait()
        return all(torch.equal(linear(x, weight), e) for x, e in zip(inputs, expected, strict=True))

    with ThreadPoolExecutor(4) as executor:
        assert all(executor.map(run, range(40)))


def _child(panels: torch.Tensor, x: torch.Tensor, expected: torch.Tensor, queue) -> None:
    torch.set_num_threads(2)
    queue.put(torch.equal(linear(x, panels), expected))


def test_a_forked_child_runs_the_ops(weight, threads):
    """The parent's workers do not survive fork: the child makes its own pool."""
    torch.set_num_threads(2)
    x = torch.randn(2, K)
    expected = linear(x, weight)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(weight, x, expected, queue))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the child hung or died"
    assert queue.get(timeout=5)


def test_idle_workers_sleep(weight, threads):
    """The workers spin for SKIFF_CPU_SPIN_US (200 us) after their last work, then sleep:
    an idle worker process burns no core."""
    torch.set_num_threads(2)
    x = torch.randn(1, K)
    for _ in range(50):
        linear(x, weight)
    time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.2
