"""CuPy, Numba and PyTorch sharing one gpupool pool in one process, handing data on without copies.

What it shows
-------------
Left alone, each array library keeps its own cache of GPU memory, and what one library caches
the others cannot use. Here all three allocate from gpupool's pool for the device:

``CuPy``
    ``cupy.cuda.set_allocator(gpupool.cupy.allocator())``
``Numba``
    ``gpupool.numba.use()``, the External Memory Management plugin (or, with no code change,
    ``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba``)
``PyTorch``
    a ``torch.cuda.MemPool`` over the extension's pluggable-allocator entry points
    (``gpupool_torch_malloc`` / ``gpupool_torch_free``)

and one batch goes through a small pipeline, every hand-off sharing the producer's memory:

1. CuPy draws a batch of signals, one per row;
2. a Numba kernel standardises each row (zero mean, unit variance) into an array Numba
   allocates, reading CuPy's array through the CUDA Array Interface;
3. PyTorch projects Numba's output with a weight matrix, reading it through the CUDA Array
   Interface (``torch.as_tensor``);
4. CuPy sums each row of the projection, reading PyTorch's tensor through DLPack.

It checks the result against NumPy, that every hand-off kept the producer's address, that each
library's allocations reached the gpupool pool and that CuPy's own pool stayed empty, and
prints ``gpupool.pool_status()``: one pool serving all three. Every step runs on the legacy
default stream, which orders the libraries' kernels one after another.

Running it
----------
It needs an NVIDIA GPU, CuPy, numba-cuda and PyTorch (gpupool's simulated device cannot run
their kernels)::

    python examples/mixed_frameworks.py

Exit status: 0 when every check passed, 1 when one failed, 2 when the GPU or a library is
missing (one line on stderr, naming the missing GPU first, then every library missing).
"""

import argparse
import importlib
import math
import sys
import warnings

import _gpu
import numpy as np

# numba-cuda 0.30 registers an overload for np.row_stack, which NumPy 2.5 removed, when it
# first compiles a kernel: alias it so the Numba kernel below compiles on such machines.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

ROWS, COLS, FEATURES = 4096, 1024, 256
THREADS = 128
FRAMEWORKS = (("cupy", "cupy"), ("numba.cuda", "numba"), ("torch", "torch"))  # gpupool's extras


class SetupError(Exception):
    """The GPU or a library is missing: exit status 2."""


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


def parse(argv):
    """The command line: no options but ``--help``, which works whatever is missing."""
    head, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=head, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=rest.split("Running it\n----------\n")[1].replace("::", ":"))
    return p.parse_args(argv)


def import_frameworks():
    """``(cupy, numba.cuda, torch)``; SetupError naming every one missing."""
    modules, missing = [], []
    for name, extra in FRAMEWORKS:
        with warnings.catch_warnings():     # some installs warn at import; the error matters
            warnings.simplefilter("ignore")
            try:
                modules.append(importlib.import_module(name))
            except Exception as exc:  # not installed, or an install that cannot load
                missing.append((name, extra, _one_line(exc)))
    if missing:
        names = ", ".join(name for name, _, _ in missing)
        install = ",".join(extra for _, extra, _ in missing)
        why = "; ".join(f"{name}: {error}" for name, _, error in missing)
        raise SetupError(f"{names} cannot be imported (pip install 'gpupool[{install}]'): {why}")
    return tuple(modules)


def set_up():
    """``(cupy, numba.cuda, torch, gpupool, pool)``: the libraries and device 0's default
    pool; SetupError naming all that is missing in one line, the GPU first (gpupool finds the
    driver without the libraries, so a machine without a GPU says so before any install)."""
    import gpupool

    try:
        cp, cuda, torch = import_frameworks()
    except SetupError as exc:
        library = str(exc)
    else:
        library = None
    missing = _gpu.missing(library)
    if missing:
        raise SetupError(f"this example needs an NVIDIA GPU, CuPy, numba-cuda and PyTorch, but "
                         f"{missing}")
    if not torch.cuda.is_available():
        raise SetupError("PyTorch sees no CUDA GPU (a CPU-only build of PyTorch?)")
    import gpupool.cupy
    import gpupool.numba

    return cp, cuda, torch, gpupool, gpupool.get_pool(0)


def torch_mempool(torch):
    """A ``torch.cuda.MemPool`` whose memory comes from gpupool's default pools."""
    try:
        from gpupool.torch import mempool
    except ImportError:
        from gpupool.adapters import torch_entry

        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            torch_entry.__file__, "gpupool_torch_malloc", "gpupool_torch_free")
        return torch.cuda.MemPool(allocator.allocator())
    return mempool()


def make_standardise(cuda):
    """A Numba kernel: ``out[r] = (x[r] - mean(x[r])) / std(x[r])``, one thread per row."""

    @cuda.jit
    def standardise(x, out):
        row = cuda.grid(1)
        if row < x.shape[0]:
            n = x.shape[1]
            total = 0.0
            for j in range(n):
                total += x[row, j]
            mean = total / n
            squares = 0.0
            for j in range(n):
                squares += (x[row, j] - mean) ** 2
            scale = 1.0 / math.sqrt(squares / n + 1e-6)
            for j in range(n):
                out[row, j] = (x[row, j] - mean) * scale

    return standardise


def address(array):
    """Device address of a CUDA Array Interface exporter (CuPy, Numba, PyTorch)."""
    return array.__cuda_array_interface__["data"][0]


class Stages:
    """Allocations the pool served during each stage of the pipeline."""

    def __init__(self, pool):
        self.pool, self.rows = pool, []
        self._mark = pool.stats().num_allocs

    def done(self, title):
        allocs = self.pool.stats().num_allocs
        self.rows.append((title, allocs - self._mark))
        self._mark = allocs

    def print(self):
        width = max(len(title) for title, _ in self.rows)
        print(f"{'stage':{width}}  allocations served by gpupool")
        for title, count in self.rows:
            print(f"{title:{width}}  {count:+d}")


def run(cp, cuda, torch, gpupool, pool):
    """The pipeline; returns ``(check, passed)`` pairs."""
    cp.cuda.set_allocator(gpupool.cupy.allocator())
    gpupool.numba.use()                      # before Numba's first CUDA call
    mempool = torch_mempool(torch)
    torch.set_float32_matmul_precision("highest")     # IEEE float32, to compare with NumPy
    stages = Stages(pool)

    x = cp.random.default_rng(0).standard_normal((ROWS, COLS), dtype=cp.float32) * 3 + 1
    stages.done("1. CuPy: draw the signals")

    x_numba = cuda.as_cuda_array(x)
    y = cuda.device_array((ROWS, COLS), dtype=np.float32)
    make_standardise(cuda)[-(-ROWS // THREADS), THREADS](x_numba, y)
    stages.done("2. Numba: standardise each row")

    with torch.cuda.use_mem_pool(mempool):
        y_torch = torch.as_tensor(y, device="cuda:0")
        generator = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(COLS, FEATURES, device="cuda", generator=generator)
        z = y_torch @ w
    stages.done("3. PyTorch: project (MemPool)")

    z_cupy = cp.from_dlpack(z)
    sums = z_cupy.sum(axis=1)
    stages.done("4. CuPy: sum the rows")

    x_host = cp.asnumpy(x).astype(np.float64)
    y_ref = (x_host - x_host.mean(axis=1, keepdims=True)) / np.sqrt(
        x_host.var(axis=1, keepdims=True) + 1e-6)
    z_ref = y_ref @ w.cpu().numpy().astype(np.float64)
    z_host = cp.asnumpy(z_cupy)
    checks = [
        ("CuPy -> Numba (CUDA Array Interface) shares the memory", address(x_numba) == address(x)),
        ("Numba -> PyTorch (CUDA Array Interface) shares the memory",
         y_torch.data_ptr() == address(y)),
        ("PyTorch -> CuPy (DLPack) shares the memory", z_cupy.data.ptr == z.data_ptr()),
        ("every library allocated from the gpupool pool",
         all(count > 0 for _, count in stages.rows)),
        ("CuPy's own memory pool stayed empty", cp.get_default_memory_pool().total_bytes() == 0),
        ("Numba's memory manager is gpupool's",
         type(cuda.current_context().memory_manager).__name__ == "GpupoolNumbaManager"),
        ("the projection matches NumPy", np.allclose(z_host, z_ref, rtol=1e-4, atol=1e-3)),
        ("the row sums match NumPy",
         np.allclose(cp.asnumpy(sums), z_host.astype(np.float64).sum(axis=1), rtol=1e-4,
                     atol=1e-3)),
    ]

    stages.print()
    print()
    gpupool.pool_status(pool=pool)
    del x_numba, y_torch, w, z, z_cupy, sums
    torch.cuda.synchronize()
    del mempool
    torch.cuda.empty_cache()
    return checks


def main(argv=None):
    parse(argv)
    try:
        cp, cuda, torch, gpupool, pool = set_up()
    except SetupError as exc:
        print(f"mixed_frameworks: {exc}", file=sys.stderr)
        return 2
    checks = run(cp, cuda, torch, gpupool, pool)
    print()
    for title, passed in checks:
        print(f"[{'ok' if passed else 'FAIL'}] {title}")
    return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
