"""CuPy adapter: CuPy arrays allocated from a gpupool pool.

::

    import cupy, gpupool, gpupool.cupy
    cupy.cuda.set_allocator(gpupool.cupy.allocator())       # every CuPy allocation
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        ...                                                 # or only here, from `pool`

Each allocation is a :class:`gpupool.DeviceBuffer` on CuPy's current stream, wrapped as
``cupy.cuda.UnownedMemory`` that keeps the buffer alive; regions apply to it as to any other
allocation. The allocator is compiled (``gpupool.adapters.cupy_allocator``); CuPy is imported
when an allocator is made, not when this module is.
"""

import gpupool
from gpupool.adapters.cupy_allocator import CupyAllocator
from gpupool.core.pool import Pool
from gpupool.errors import import_extra, refuse_host_memory
from gpupool.public import public_dir

__all__ = ["allocator"]


def __dir__():
    """The public API and the module's dunder attributes, not the names it imports."""
    return public_dir(globals(), __all__)


def allocator(pool=None):
    """An allocator for ``cupy.cuda.set_allocator`` / ``cupy.cuda.using_allocator``.

    Parameters
    ----------
    pool : gpupool.Pool, optional
        The pool to draw from; default: ``gpupool.get_pool(d)`` for CuPy's current device
        ``d`` at each call (``gpupool.set_pool`` applies to the next call).

    Returns
    -------
    callable
        ``alloc(nbytes) -> cupy.cuda.MemoryPointer``, ``nbytes`` an int in bytes: the
        ``malloc`` method of a compiled ``gpupool.adapters.cupy_allocator.CupyAllocator``
        (``alloc.__self__``), like CuPy's own ``MemoryPool().malloc``. Each call allocates
        through the same path as ``Pool.allocate``, for CuPy's current stream
        (``cupy.cuda.get_current_stream().ptr``), so the calling thread's current region caches the block; the ``DeviceBuffer`` is
        wrapped as ``cupy.cuda.UnownedMemory(ptr, nbytes, buffer, device)`` and its block
        returns to the pool (or region) when CuPy drops that memory. ``alloc(0)`` gives
        ``MemoryPointer(Memory(0), 0)`` without touching the pool.

    Raises
    ------
    TypeError
        ``pool`` is not a ``gpupool.Pool``.
    ValueError
        ``pool`` is on a simulated device (host memory, which CuPy's kernels cannot use).
        Default pools, looked up at each call, are not checked.
    ImportError
        CuPy is not installed.

    The returned callable raises ``ValueError`` when the pool belongs to another device than
    CuPy's current one (``cupy.cuda.runtime.getDevice()``), and whatever ``Pool.allocate``
    raises: ``gpupool.OutOfMemoryError`` after the ``on_oom`` callbacks,
    ``gpupool.CudaError``, ``gpupool.GpupoolError`` in a child after ``fork()``.
    """
    if pool is not None and not isinstance(pool, Pool):
        raise TypeError(f"pool must be a gpupool.Pool or None, got {type(pool).__name__}")
    if pool is not None:
        refuse_host_memory(pool, "CuPy's device allocations")
    cupy = import_extra("cupy", "cupy", "CuPy for CUDA 13", "cupy-cuda13x")
    return CupyAllocator.for_cupy(cupy, pool, gpupool.get_pool).malloc
