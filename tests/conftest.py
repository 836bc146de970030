"""Shared fixtures: a pool on the simulated device for CPU tests, skipping of GPU tests, and
running the repository's scripts in a subprocess.

The test files sit in folders that mirror the package's layers (tests/core/ for gpupool/core/,
...; package-wide tests at this level), with no __init__.py: pytest imports each file by its
basename, so basenames are unique across the folders. This folder is on sys.path (pytest puts
it there for this file), so the shared helpers beside it (capi_table, fake_cupy, torch_child)
import from every folder. GPU tests carry the ``gpu`` marker and sit in their CPU twin's file;
they skip where there is no GPU."""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpupool
from gpupool.testing import SimulatedDevice

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

# numba-cuda 0.30 registers an overload for np.row_stack, which NumPy 2.5 removed, when it
# first compiles a kernel: alias it so Numba's kernels compile on such machines.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack


# CuPy keeps one array of every step alive when run under compute-sanitizer, with its own
# pool as with gpupool's, so a check that reserved memory stays flat across a CuPy loop cannot
# hold there. tools/gpu/gpu-check.sh sets this.
flat_memory_unmeasurable = pytest.mark.skipif(
    os.environ.get("GPUPOOL_UNDER_SANITIZER") == "1",
    reason="under compute-sanitizer CuPy leaks one array per step, with its own pool too")


# A CUDA kernel for GPU tests of stream order: slow_write(out, n, spin) spins for `spin` clock
# cycles, then writes 42 into the n bytes at out (a kernel still running when the test asks).
SLOW_WRITE = r"""
extern "C" __global__ void slow_write(unsigned char* out, long long n, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = 42;
    }
}
"""


@functools.cache
def gpu_available():
    """Whether a CUDA driver and at least one device are present."""
    try:
        gpupool.get_pool(0)
    except gpupool.NoDeviceError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def oom_callback():
    """``oom_callback(fn)`` registers fn with ``gpupool.on_oom`` for the test (returns fn)."""
    registered = []

    def register(fn):
        registered.append(gpupool.on_oom(fn))
        return fn

    yield register
    for fn in registered:
        gpupool.remove_oom_callback(fn)


def checked(device):
    """For a fixture (``yield from checked(device)``): the simulated device, then, when the
    test ends, the check that the pool never misused it (``device.errors``)."""
    yield device
    assert device.errors == [], "the pool misused the simulated device"


@pytest.fixture
def sim():
    yield from checked(SimulatedDevice(capacity=1 << 30))


@pytest.fixture
def pool(sim):
    return gpupool.Pool(upstream=sim)


def check_invariants(pool):
    """Bytes in use plus bytes cached (pool and regions) equal bytes reserved, and the pool's
    bookkeeping is consistent (Pool._verify: segments, free lists, region tags, counters)."""
    assert pool._verify() == []
    stats = pool.stats()
    assert stats.in_use_bytes + stats.cached_bytes == stats.reserved_bytes
    assert stats.peak_in_use_bytes >= stats.in_use_bytes
    assert stats.peak_reserved_bytes >= stats.reserved_bytes
    return stats


@pytest.fixture
def default_pools():
    """Put gpupool's default pools back after a test that replaces them with set_pool."""
    saved = dict(gpupool._pools)
    yield
    for device in set(saved) | set(gpupool._pools):
        if gpupool._pools.get(device) is not saved.get(device):
            gpupool._pools.pop(device, None)
            if device in saved:
                gpupool._pools[device] = saved[device]
            gpupool.core.defaults._forget(device)


def fresh_python(code, *flags, timeout=120):
    """Run ``code`` (dedented) in a fresh interpreter started in the tests folder (so that
    ``fake_cupy`` imports), with interpreter ``flags`` (``"-W", "error"``); returns the
    CompletedProcess, stdout and stderr as text."""
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd=TESTS)


@pytest.fixture
def run_script():
    """``run_script(path, *args, env=None, timeout=600)``: run the repository's script ``path``
    (relative to the repository, e.g. ``examples/train_digits.py``) with ``sys.executable``
    from the repository's root; returns ``(CompletedProcess, output)``, ``output`` being its
    stdout and stderr for assertion messages. ``env`` None: this process's environment."""

    def run(path, *args, env=None, timeout=600):
        proc = subprocess.run([sys.executable, str(REPO / path), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
        return proc, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    return run


def simulated_default_pool(hard_limit):
    """For a fixture (``yield from``): device 0's default pool on a 64 MiB simulated device
    under a hard limit of hard_limit bytes; after the test, the device saw no misuse."""
    sim = SimulatedDevice(capacity=64 << 20)
    pool = gpupool.Pool(upstream=sim, device=0, hard_limit=hard_limit)
    gpupool.set_pool(pool)
    yield pool
    assert sim.errors == []


def threads_together(target, args_of):
    """Run target(*args) on one thread per entry of args_of, all at once; wait for them."""
    import threading
    workers = [threading.Thread(target=target, args=args) for args in args_of]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)


def on_thread(fn, *args):
    """fn(*args) on a new thread that then exits; its result."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(fn, *args).result(timeout=60)


def hold_lock(pool, device, nbytes=1 << 30):
    """Make a thread hold pool's lock: it allocates nbytes, which grows the pool, and waits
    inside device's next map (the pool's upstream call, its lock held) until the returned
    event is set. Returns (that event, the thread) once the lock is held."""
    import threading
    held, go = threading.Event(), threading.Event()
    map_pages = device._map

    def held_map(va, size):
        device._map = map_pages
        held.set()
        go.wait()
        return map_pages(va, size)

    device._map = held_map
    thread = threading.Thread(target=lambda: pool.allocate(nbytes).close())
    thread.start()
    held.wait()
    return go, thread


def check_balanced(pool, pairs):
    """After pairs allocations, each freed: the pool's invariants hold, nothing is in use and
    the counts agree. Returns the pool's stats."""
    stats = check_invariants(pool)
    assert stats.in_use_bytes == 0
    assert stats.num_allocs == stats.num_frees == pairs
    return stats


class Worker:
    """A long-lived thread that runs what it is given, in turn (its magazines are its own)."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor
        self._executor = ThreadPoolExecutor(1)

    def __call__(self, fn, *args):
        return self._executor.submit(fn, *args).result(timeout=60)

    def exit(self):
        self._executor.shutdown(wait=True)
