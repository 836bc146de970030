"""CuPy adapter: CuPy arrays allocated from a gpupool pool.

::

    import cupy, gpupool, gpupool.cupy
    cupy.cuda.set_allocator(gpupool.cupy.allocator())       # every CuPy allocation
    with cupy.cuda.using_allocator(gpupool.cupy.allocator(pool)):
        ...                                                 # or only here, from `pool`

Each allocation is a :class:`gpupool.DeviceBuffer` on CuPy's current stream, wrapped as
``cupy.cuda.UnownedMemory`` that keeps the buffer alive; regions apply to it as to any other
allocation. CuPy is imported when an allocator is first called, not when this module is.
"""

__all__ = ["allocator"]


def allocator(pool=None):
    """An allocator for ``cupy.cuda.set_allocator`` / ``cupy.cuda.using_allocator``.

    Parameters
    ----------
    pool : gpupool.Pool, optional
        The pool to draw from; default: ``gpupool.get_pool(d)`` for CuPy's current device
        ``d`` at each call.

    Returns
    -------
    callable
        ``alloc(nbytes) -> cupy.cuda.MemoryPointer``. The memory is allocated for CuPy's
        current stream (``cupy.cuda.get_current_stream()``).

    Raises (from the returned callable)
    ------
    gpupool.OutOfMemoryError
        As ``Pool.allocate``.
    ValueError
        ``pool`` belongs to another device than CuPy's current one.
    """
    import cupy

    from gpupool import get_pool

    memory_pointer = cupy.cuda.MemoryPointer
    unowned = cupy.cuda.UnownedMemory
    empty = cupy.cuda.memory.Memory
    current_stream = cupy.cuda.get_current_stream
    current_device = cupy.cuda.runtime.getDevice

    def alloc(nbytes):
        device = current_device()
        source = get_pool(device) if pool is None else pool
        if source.device != device:
            raise ValueError(
                f"gpupool pool of device {source.device} used while CuPy's current device is "
                f"{device}; make one allocator per device")
        if nbytes == 0:
            return memory_pointer(empty(0), 0)
        buf = source.allocate(nbytes, current_stream().ptr)
        return memory_pointer(unowned(buf.ptr, nbytes, buf, device), 0)

    return alloc
