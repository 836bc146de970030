# cython: language_level=3, boundscheck=False, wraparound=False
"""The CuPy allocator, compiled: the callable behind ``gpupool.cupy.allocator``.

CuPy is neither cimported nor imported here (it is optional): ``gpupool.cupy`` hands the
CuPy functions and classes the allocator calls to :class:`CupyAllocator` when an allocator
is made. Each call resolves the device, the pool and the stream, takes the block through
the pool's own allocation path (``Pool.allocate_on``, the body of ``Pool.allocate``) and
wraps it for CuPy, without interpreted Python of gpupool's own in between.
"""
from cpython.ref cimport PyObject
from gpupool.buffer.device_buffer cimport DeviceBuffer
from gpupool.core.defaults cimport registered_pool
from gpupool.core.pool cimport Pool
from gpupool.records.streams cimport stream_handle

cdef class CupyAllocator:
    """CuPy's allocator interface over a gpupool pool: ``malloc(nbytes)`` (or a call) returns
    a ``cupy.cuda.MemoryPointer``; :func:`gpupool.cupy.allocator` makes one and returns its
    ``malloc``.

    Parameters
    ----------
    pool : gpupool.Pool or None
        The pool to draw from; None: ``gpupool.get_pool(d)`` for CuPy's current device ``d``
        at each call (looked up in gpupool's table of default pools, so ``set_pool`` applies
        to the next call).
    get_pool : callable
        ``(device) -> Pool``, the default pool of a device (``gpupool.get_pool``).
    current_device : callable
        ``() -> int``, CuPy's current device (``cupy.cuda.runtime.getDevice``).
    stream_ptr : callable or None
        ``() -> int``, the handle of CuPy's current stream
        (``cupy.cuda.stream.get_current_stream_ptr`` where CuPy exports it).
    current_stream : callable
        ``() -> stream`` with ``.ptr`` (``cupy.cuda.get_current_stream``), used when
        ``stream_ptr`` is None.
    unowned_memory, memory_pointer, memory : type
        ``cupy.cuda.UnownedMemory``, ``cupy.cuda.MemoryPointer`` and ``cupy.cuda.memory.Memory``
        (the last for zero-byte requests, as CuPy's own pool answers them).
    """

    cdef readonly Pool pool
    cdef object _get_pool
    cdef object _current_device
    cdef object _stream_ptr
    cdef object _current_stream
    cdef object _unowned
    cdef object _pointer
    cdef object _memory

    def __init__(self, Pool pool, *, get_pool, current_device, stream_ptr, current_stream,
                 unowned_memory, memory_pointer, memory):
        for name, value in (("get_pool", get_pool), ("current_device", current_device),
                            ("current_stream", current_stream),
                            ("unowned_memory", unowned_memory),
                            ("memory_pointer", memory_pointer), ("memory", memory)):
            if not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if stream_ptr is not None and not callable(stream_ptr):
            raise TypeError(f"stream_ptr must be callable or None, got "
                            f"{type(stream_ptr).__name__}")
        self.pool = pool
        self._get_pool = get_pool
        self._current_device = current_device
        self._stream_ptr = stream_ptr
        self._current_stream = current_stream
        self._unowned = unowned_memory
        self._pointer = memory_pointer
        self._memory = memory

    @classmethod
    def for_cupy(cls, cupy, pool, get_pool):
        """An allocator over ``pool`` (None: ``get_pool(d)`` at each call) calling the CuPy
        functions and classes of the module ``cupy``, or of a stand-in with the same names
        (``tests/fake_cupy.py``, whose memory may be the simulated device's).

        Raises
        ------
        AttributeError
            ``cupy`` lacks one of them.
        """
        return cls(
            pool,
            get_pool=get_pool,
            current_device=cupy.cuda.runtime.getDevice,
            stream_ptr=getattr(getattr(cupy.cuda, "stream", None), "get_current_stream_ptr",
                               None),
            current_stream=cupy.cuda.get_current_stream,
            unowned_memory=cupy.cuda.UnownedMemory,
            memory_pointer=cupy.cuda.MemoryPointer,
            memory=cupy.cuda.memory.Memory,
        )

    def malloc(self, nbytes):
        """Allocate ``nbytes`` (int, bytes, >= 0) on CuPy's current device and stream.

        The bound method is what ``gpupool.cupy.allocator`` returns, as CuPy's own
        ``MemoryPool().malloc``: CPython calls it through vectorcall, where calling the
        instance (``__call__``, the same allocation) packs the argument into a tuple first.

        Returns
        -------
        cupy.cuda.MemoryPointer
            Offset 0 into ``UnownedMemory(ptr, nbytes, buffer, device)``, which keeps the
            ``DeviceBuffer`` alive: the block returns to its pool (or region) when CuPy drops
            the memory. Zero bytes: ``MemoryPointer(Memory(0), 0)``, no pool call.

        Raises
        ------
        ValueError
            The pool belongs to another device than CuPy's current one; ``nbytes`` negative
            or absurd (``Pool.allocate``).
        TypeError
            ``nbytes`` not an integer.
        gpupool.OutOfMemoryError, gpupool.CudaError, gpupool.GpupoolError
            As ``Pool.allocate`` (out of memory after the ``on_oom`` callbacks, a driver
            failure, a pool inherited through ``fork()``).
        """
        return self._allocate(nbytes)

    def __call__(self, nbytes):
        """The same as :meth:`malloc`."""
        return self._allocate(nbytes)

    cdef object _allocate(self, object nbytes):
        cdef object device = self._current_device()
        cdef int ordinal = device
        cdef Pool pool = self.pool
        cdef PyObject* found
        cdef DeviceBuffer buf
        if pool is None:
            found = registered_pool(ordinal)
            pool = <Pool>(<object>found) if found != NULL else self._get_pool(device)
        if pool.device != ordinal:
            raise ValueError(
                f"gpupool pool of device {pool.device} used while CuPy's current device is "
                f"{ordinal}; make one allocator per device")
        if nbytes == 0:
            return self._pointer(self._memory(0), 0)
        if self._stream_ptr is not None:
            stream = self._stream_ptr()
        else:
            stream = self._current_stream().ptr
        buf = <DeviceBuffer>pool.allocate_on(nbytes, pool.check_stream(stream_handle(stream)))
        return self._pointer(self._unowned(buf._ptr, nbytes, buf, device), 0)

    def __repr__(self):
        source = "the current device's default pool" if self.pool is None else repr(self.pool)
        return f"<gpupool.cupy allocator from {source}>"
