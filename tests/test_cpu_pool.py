"""The CPU kernels' thread pool (``cpu/csrc/pool.c``): results do not depend on how many
threads run, on which of them claims which item, on a second caller running at the same time,
or on the process having been forked after the pool started."""

import multiprocessing
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from support.kernels import Layer

from nanokv_cli.engine.cpu import build, kernels
from nanokv_cli.engine.cpu.kernels import LINEAR_Q4P, LINEAR_Q8P

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")


def packed_layer(kind: int, out_features: int = 1000, in_features: int = 576):
    """A random packed layer (support/kernels.py: its C spec, and the layer that owns the bytes)."""
    layer = Layer(kind, out_features, in_features, seed=kind)
    return layer.spec(), layer


def with_threads(count: int, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kind", [LINEAR_Q4P, LINEAR_Q8P], ids=["q4p", "q8p"])
def test_any_thread_count_gives_the_same_bits(kind):
    spec, _packed = packed_layer(kind)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3))
    one = with_threads(1, lambda: kernels.linear(spec, x))
    for count in (2, 3, 8):  # more threads than this machine has cores, too
        assert torch.equal(with_threads(count, lambda: kernels.linear(spec, x)), one)


def test_concurrent_callers_each_get_their_own_result():
    # ctypes lets both Python threads into the kernels at once: one job runs on the pool, the
    # other on its own thread, and neither may see the other's items.
    layers = [packed_layer(LINEAR_Q4P), packed_layer(LINEAR_Q8P, 700)]
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(n, 576, generator=g) for n in (1, 7, 64)]
    expected = [
        [with_threads(1, lambda s=s, x=x: kernels.linear(s, x)) for x in inputs] for s, _ in layers
    ]
    failures = []
    start = threading.Barrier(len(layers))

    def caller(index: int) -> None:
        torch.set_num_threads(2)
        spec = layers[index][0]
        start.wait()
        for _ in range(200):
            for x, want in zip(inputs, expected[index]):
                if not torch.equal(kernels.linear(spec, x), want):
                    failures.append(index)
                    return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(layers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert failures == []


def _child(spec, x, queue) -> None:
    # no torch parallel op here: torch's own OpenMP pool is not fork-safe
    torch.set_num_threads(2)
    queue.put(kernels.linear(spec, x).numpy().tobytes())  # plain bytes: no shared memory


def test_a_forked_child_gets_the_same_result_on_a_pool_of_its_own():
    spec, packed = packed_layer(LINEAR_Q4P)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(5))
    # the parent's helpers exist (they run this product) and are not copied into the child
    expected = with_threads(2, lambda: kernels.linear(spec, x))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(spec, x, queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert result == expected.numpy().tobytes()
    del packed


@pytest.mark.slow
def test_jobs_issued_back_to_back_each_run_every_item_once(tmp_path):
    # A replayed step issues its jobs from C with no Python between them, a gap too short for
    # a Python test to hit its races often: tests/csrc/pool_stress.c issues half a million, on
    # more threads than this machine has cores, too (a helper descheduled mid-job).
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    stress = tmp_path / "pool_stress"
    sources = [Path(__file__).with_name("csrc") / "pool_stress.c", build.SOURCE_DIR / "pool.c"]
    subprocess.run(
        [compiler, "-O2", "-pthread", f"-I{build.SOURCE_DIR}", "-o", stress, *sources],
        check=True,
        timeout=120,
    )
    for threads in (2, 3, 4):
        result = subprocess.run(
            [stress, "500000", str(threads)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{threads} threads: {result.stdout}"
