# cython: language_level=3, boundscheck=False, wraparound=False
"""DeviceBuffer: one block of device memory, readable by any array library without a copy.

It exports the CUDA Array Interface (version 3) and copies to and from host memory on a
stream. Its block goes back to the pool, or to the region it was allocated in, when its last
reference goes or when it is closed.
"""
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.stdint cimport uintptr_t
from gpupool._block cimport Block, StreamKey
from gpupool._pool cimport (
    Pool, set_buffer_factory, stream_key, stream_handle, forked,
)
from gpupool._upstream cimport HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE

# DLPack 1.x (dlpack.h): the structures a consumer reads from the capsule.
cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept nogil

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void* manager_ctx
    void (*deleter)(DLManagedTensorVersioned*) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor

cdef enum:
    DLPACK_MAJOR = 1
    DLPACK_MINOR = 1
    KDL_CPU = 1
    KDL_CUDA = 2
    KDL_UINT = 1

cimport cython

import numpy as np

from gpupool.errors import InvalidBufferError
from gpupool.interface import read_cai


cdef object _new_buffer(Pool pool, Block* blk, size_t nbytes, StreamKey stream):
    cdef DeviceBuffer buf = DeviceBuffer.__new__(DeviceBuffer)
    buf.pool = pool
    buf._blk = blk
    buf.nbytes = nbytes
    buf._stream = stream
    if blk != NULL:
        buf._ptr = blk.ptr
        blk.buffer = <PyObject*>buf
    return buf


set_buffer_factory(_new_buffer)


# The manager context is the DeviceBuffer (a strong reference) and the shape lives in the same
# allocation as the tensor, so the deleter frees one block and drops one reference. A deleter
# may run without the GIL (a consumer's C code), so it takes it.
cdef void _delete_legacy(DLManagedTensor* tensor) noexcept nogil:
    with gil:
        Py_DECREF(<object>tensor.manager_ctx)
    free(tensor)


cdef void _delete_versioned(DLManagedTensorVersioned* tensor) noexcept nogil:
    with gil:
        Py_DECREF(<object>tensor.manager_ctx)
    free(tensor)


cdef void _capsule_legacy(object capsule) noexcept:
    # Still named "dltensor": no consumer took it, so the producer deletes it.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        tensor = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        tensor.deleter(tensor)


cdef void _capsule_versioned(object capsule) noexcept:
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        tensor = <DLManagedTensorVersioned*>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        tensor.deleter(tensor)


cdef void _fill_after(DLTensor* t, void* storage, DeviceBuffer buf, int device_type, int code,
                      int bits, tuple shape, tuple strides) noexcept:
    """Describe the buffer's memory; shape and strides (in elements, or None) are written to
    storage, the end of the same allocation."""
    cdef int64_t* dims = <int64_t*>storage
    cdef Py_ssize_t i, ndim = len(shape)
    t.data = <void*>buf._ptr
    t.device.device_type = device_type
    t.device.device_id = buf.pool.device if device_type == KDL_CUDA else 0
    t.ndim = <int32_t>ndim
    t.dtype.code = code
    t.dtype.bits = bits
    t.dtype.lanes = 1
    for i in range(ndim):
        dims[i] = shape[i]
        if strides is not None:
            dims[ndim + i] = strides[i]
    t.shape = dims
    t.strides = dims + ndim if strides is not None else NULL
    t.byte_offset = 0


cdef inline object _cai_stream(uintptr_t handle):
    # CAI v3: 1 is the legacy default stream, 2 the per-thread default stream; 0 is not allowed.
    return 1 if handle == 0 else handle


# Not tracked by the garbage collector: a buffer refers only to its pool, which never refers
# back, and the collector's tp_clear would otherwise drop the pool before __dealloc__ runs.
@cython.no_gc
cdef class DeviceBuffer:
    """Device memory owned by a pool; made by ``Pool.allocate`` or ``gpupool.allocate``.

    Attributes
    ----------
    ptr : int
        Device pointer (256-byte aligned; 0 for an empty buffer).
    nbytes : int
        Size requested, in bytes.
    device : int
        Device ordinal.
    stream : int
        Handle of the stream the buffer is used on (0: legacy default stream). Assign a new
        handle or stream object when the buffer moves to another stream: its block is then
        reused on that stream without a wait, and on others only after that stream's work.
    pool : Pool
        The pool that owns the memory.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("DeviceBuffer is made by Pool.allocate() or gpupool.allocate()")

    def __dealloc__(self):
        # Never raises; a buffer inherited through fork() is left alone.
        if self._blk != NULL and not forked():
            self.pool.release(self._blk, self._stream)
            self._blk = NULL

    cdef uintptr_t _live_ptr(self) except? 0:
        if self._state == OPEN:
            return self._ptr
        if self._state == CLOSED:
            raise InvalidBufferError("the buffer was closed; its memory went back to the pool")
        raise InvalidBufferError(
            "the buffer was invalidated when its region exited (on_exit='invalidate'); keep it "
            "with region.keep(buf), or allocate it under gpupool.uncached() to outlive the step")

    cdef void invalidate_locked(self) noexcept:
        """Mark the buffer invalid; the caller holds the pool's lock and frees the block."""
        self._state = INVALIDATED
        self._blk = NULL

    @property
    def ptr(self):
        """Device pointer (``CUdeviceptr``) as an int; raises if closed or invalidated."""
        return self._live_ptr()

    @property
    def device(self):
        """Device ordinal of the memory."""
        return self.pool.device

    @property
    def closed(self):
        """True once the buffer was closed or invalidated."""
        return self._state != OPEN

    @property
    def stream(self):
        """Handle of the stream the buffer is used on (0: the legacy default stream)."""
        return self._stream.handle

    @stream.setter
    def stream(self, stream):
        cdef uintptr_t handle = stream_handle(stream)
        self._live_ptr()
        self._stream = stream_key(handle) if self.pool is None else self.pool.checked_key(handle)

    @property
    def __cuda_array_interface__(self):
        """CUDA Array Interface v3: a 1-D ``|u1`` array of ``nbytes`` over the memory.

        ``stream`` is the buffer's stream (1 for the legacy default stream, 2 for the
        per-thread one), so consumers order their work after the producer's.
        """
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self._live_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": _cai_stream(self._stream.handle),
        }

    def __dlpack_device__(self):
        """``(device_type, device_id)`` per the DLPack spec: ``(2, ordinal)`` (kDLCUDA), or
        ``(1, 0)`` (kDLCPU) for an upstream whose memory is host memory (the simulated
        device)."""
        if getattr(self.pool.upstream, "dlpack_host_memory", False):
            return (KDL_CPU, 0)
        return (KDL_CUDA, self.pool.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export the bytes as a DLPack capsule: a 1-D ``uint8`` tensor of ``nbytes``.

        Parameters
        ----------
        stream : int or None
            The consumer's stream (DLPack's convention for CUDA: 1 the legacy default stream,
            2 the per-thread one, -1 no synchronization, None the legacy default stream). The
            pool makes it wait on the buffer's stream (an event and ``cuStreamWaitEvent``), so
            the consumer's work runs after the producer's; the host does not wait.
        max_version : tuple of int, optional
            The highest DLPack version the consumer reads: ``(1, x)`` or later gives a
            versioned capsule ("dltensor_versioned"); None gives the legacy "dltensor".
        dl_device : tuple, optional
            Must be this buffer's ``__dlpack_device__()``.
        copy : bool, optional
            ``True`` is refused (gpupool exports without copying).

        Returns
        -------
        PyCapsule
            Keeps the buffer alive until the consumer's deleter runs; a capsule nobody
            consumed deletes itself when it dies. Follows the DLPack Python specification.

        Raises
        ------
        BufferError
            ``copy=True``, or another ``dl_device``.
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        return self._export(self, KDL_UINT, 8, (self.nbytes,), None, stream=stream,
                            max_version=max_version, dl_device=dl_device, copy=copy)

    def _export(self, owner, int code, int bits, tuple shape, tuple strides, *, stream,
                max_version, dl_device, copy):
        """The DLPack capsule of ``__dlpack__`` for this memory seen as ``shape`` elements of
        (DLPack type ``code``, ``bits``), strides in elements or None; ``owner`` (this
        buffer or a view of it) stays alive until the deleter runs."""
        cdef DLManagedTensor* legacy
        cdef DLManagedTensorVersioned* versioned
        cdef size_t extra = 2 * len(shape) * sizeof(int64_t)
        self._live_ptr()
        device = self.__dlpack_device__()
        if copy:
            raise BufferError("gpupool exports DLPack without copying (copy=True refused)")
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the buffer is on DLPack device {device}, not {dl_device}")
        consumer = 1 if stream is None else stream
        if consumer != -1:
            self._order_before(0 if consumer == 1 else consumer)
        if max_version is not None and not (
                isinstance(max_version, tuple) and len(max_version) == 2
                and all(type(v) is int for v in max_version)):
            raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, "
                            f"got {max_version!r}")
        if max_version is None or max_version[0] < DLPACK_MAJOR:
            legacy = <DLManagedTensor*>malloc(sizeof(DLManagedTensor) + extra)
            if legacy == NULL:
                raise MemoryError()
            # The shape follows the whole managed tensor, not just the DLTensor in it.
            _fill_after(&legacy.dl_tensor, <void*>(legacy + 1), self, device[0], code, bits,
                        shape, strides)
            legacy.manager_ctx = <void*>owner
            legacy.deleter = _delete_legacy
            Py_INCREF(owner)
            return PyCapsule_New(legacy, b"dltensor", _capsule_legacy)
        versioned = <DLManagedTensorVersioned*>malloc(sizeof(DLManagedTensorVersioned) + extra)
        if versioned == NULL:
            raise MemoryError()
        versioned.version.major = DLPACK_MAJOR
        versioned.version.minor = DLPACK_MINOR
        versioned.flags = 0
        _fill_after(&versioned.dl_tensor, <void*>(versioned + 1), self, device[0], code, bits,
                    shape, strides)
        versioned.manager_ctx = <void*>owner
        versioned.deleter = _delete_versioned
        Py_INCREF(owner)
        return PyCapsule_New(versioned, b"dltensor_versioned", _capsule_versioned)

    def view(self, dtype, shape, strides=None):
        """This memory as an array of ``dtype`` and ``shape`` (no copy): a
        :class:`gpupool.view.BufferView` exporting the CUDA Array Interface and DLPack, which
        keeps the buffer alive. ``strides`` in bytes; default C-contiguous.

        Raises
        ------
        TypeError, ValueError
            As ``BufferView``: an unsupported dtype, a shape or strides that are not ints,
            or a view past ``nbytes``.
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        from gpupool.view import BufferView

        self._live_ptr()
        return BufferView(self, dtype, shape, strides)

    def _order_before(self, consumer):
        """Make stream ``consumer`` wait for the work queued so far on the buffer's stream."""
        cdef uintptr_t event = 0
        cdef uintptr_t handle = stream_handle(consumer)
        upstream = self.pool.upstream
        if stream_key(handle).handle == self._stream.handle:
            return
        upstream.raise_error(upstream.event_create(&event), "cuEventCreate")
        try:
            upstream.raise_error(upstream.event_record(event, self._stream.handle),
                                 "cuEventRecord")
            upstream.raise_error(upstream.stream_wait(handle, event), "cuStreamWaitEvent")
        finally:
            upstream.event_destroy(event)

    def record_stream(self, stream):
        """Mark the memory as used on another stream too.

        The block is then reused only once the work submitted to ``stream`` before the
        buffer's free has completed or is ordered before its next user (as
        ``torch.Tensor.record_stream``). An event is recorded on ``stream`` at the free, so
        ``stream`` must still exist then.

        Parameters
        ----------
        stream : int, stream object or None
            See ``Pool.allocate``.
        """
        cdef uintptr_t handle = stream_handle(stream)
        self._live_ptr()
        if self._blk != NULL:
            self.pool.add_stream(self._blk, self.pool.checked_key(handle))

    def close(self):
        """Give the memory back now (to the pool or its region). Later use raises
        ``InvalidBufferError``; closing again does nothing."""
        if self._blk != NULL and not forked():
            self.pool.release(self._blk, self._stream)
        self._blk = NULL
        self._owner = None
        if self._state == OPEN:
            self._state = CLOSED

    def __enter__(self):
        self._live_ptr()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __len__(self):
        return self.nbytes

    def copy_from_host(self, src, stream=None):
        """Copy host memory (or another device buffer) into the start of this buffer.

        Parameters
        ----------
        src : numpy.ndarray, bytes-like, DeviceBuffer or CUDA Array Interface object
            Source of at most ``nbytes`` bytes: any object with the buffer protocol (a
            non-contiguous host array is first made contiguous), or a C-contiguous device
            array, copied device to device.
        stream : int, stream object or None
            Stream for the copy; default: the buffer's stream. The copy is ordered after
            earlier work on that stream; host sources can be reused when this returns
            (``cuMemcpyHtoDAsync`` with pageable memory, ``cuMemcpyDtoDAsync``).

        Raises
        ------
        TypeError
            The source has no buffer protocol (a list, a str, None) or holds Python objects.
        ValueError
            The source is larger than the buffer, or a non-contiguous device array.
        InvalidBufferError
            The buffer was closed or invalidated.
        """
        cdef uintptr_t dst = self._live_ptr()
        cdef uintptr_t s = self._stream.handle if stream is None else stream_handle(stream)
        cdef size_t n
        cai = read_cai(src)
        if cai is not None:
            if not cai.c_contiguous:
                raise ValueError("the device source must be C-contiguous")
            n = cai.nbytes
            kind, src_ptr, keep = DEVICE_TO_DEVICE, cai.ptr, src
        else:
            keep = _host_bytes(src)
            n = keep.nbytes
            kind, src_ptr = HOST_TO_DEVICE, keep.ctypes.data
        if n > self.nbytes:
            raise ValueError(f"source has {n} bytes, the buffer {self.nbytes}")
        if n:
            self.pool.upstream.raise_error(
                self.pool.upstream.copy(kind, dst, src_ptr, n, s), "copy_from_host")

    def copy_to_host(self, out=None, stream=None):
        """Copy the buffer's bytes to host memory.

        Parameters
        ----------
        out : numpy.ndarray, optional
            Writable C-contiguous array of exactly ``nbytes`` bytes (any dtype); default: a
            new ``uint8`` array of shape ``(nbytes,)``.
        stream : int, stream object or None
            Stream for the copy; default: the buffer's stream. The call returns once the
            copy (and earlier work on that stream) has completed (``cuMemcpyDtoHAsync``
            followed by ``cuStreamSynchronize``).

        Returns
        -------
        numpy.ndarray
            ``out``, filled.
        """
        cdef uintptr_t src = self._live_ptr()
        cdef uintptr_t s = self._stream.handle if stream is None else stream_handle(stream)
        if out is None:
            out = np.empty(self.nbytes, dtype=np.uint8)
        elif not isinstance(out, np.ndarray) or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise ValueError("out must be a writable C-contiguous numpy array")
        if out.nbytes != self.nbytes:
            raise ValueError(f"out has {out.nbytes} bytes, the buffer {self.nbytes}")
        if self.nbytes:
            self.pool.upstream.raise_error(
                self.pool.upstream.copy(DEVICE_TO_HOST, out.ctypes.data, src, self.nbytes, s),
                "copy_to_host")
        return out

    def memset(self, int value, stream=None):
        """Set every byte to ``value`` (0-255) on ``stream`` (default: the buffer's), ordered
        after earlier work on that stream (``cuMemsetD8Async``); does not wait for it."""
        cdef uintptr_t dst = self._live_ptr()
        cdef uintptr_t s = self._stream.handle if stream is None else stream_handle(stream)
        if not 0 <= value <= 255:
            raise ValueError(f"value must be a byte (0-255), got {value}")
        if self.nbytes:
            self.pool.upstream.raise_error(
                self.pool.upstream.memset(dst, <unsigned char>value, self.nbytes, s), "memset")

    def __repr__(self):
        state = ("", " closed", " invalidated")[<int>self._state]
        return (f"<gpupool.DeviceBuffer ptr={self._ptr:#x} nbytes={self.nbytes} "
                f"device={self.pool.device} stream={self._stream.handle:#x}{state}>")


def _host_bytes(src):
    """The bytes of a host source as a contiguous uint8 array (a view where possible)."""
    if isinstance(src, str) or not (isinstance(src, np.ndarray) or _has_buffer(src)):
        raise TypeError(
            f"copy_from_host needs a numpy array, a bytes-like object or a device array, "
            f"got {type(src).__name__}")
    array = np.asarray(src)
    if array.dtype.hasobject:
        raise TypeError("copy_from_host cannot copy an array of Python objects")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _has_buffer(obj):
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def as_buffer(obj, device=None, pool=None):
    """Wrap memory exported by another library as a non-owning DeviceBuffer (no copy).

    Parameters
    ----------
    obj : object with ``__cuda_array_interface__``
        A C-contiguous device array (CuPy, Numba, PyTorch, ...); kept alive by the buffer.
    device : int, optional
        The device of the memory; default: the current device. Its default pool serves the
        buffer's copies; the memory itself stays the exporter's and is never freed by gpupool.
    pool : Pool, optional
        The pool whose upstream serves the copies instead; default: the pool of ``obj`` when
        it is a gpupool buffer or view, else ``get_pool(device)``.

    Returns
    -------
    DeviceBuffer
        ``nbytes`` = the array's bytes; ``stream`` = the interface's stream (the legacy default
        stream when it gives none).

    Raises
    ------
    TypeError
        ``obj`` exports no CUDA Array Interface.
    ValueError
        The array is not C-contiguous, or is read-only.
    """
    from gpupool import get_pool

    cdef DeviceBuffer buf
    cai = read_cai(obj)
    if cai is None:
        raise TypeError(f"as_buffer needs an object with __cuda_array_interface__, got "
                        f"{type(obj).__name__}")
    if not cai.c_contiguous:
        raise ValueError("as_buffer needs a C-contiguous array")
    if cai.readonly:
        raise ValueError("as_buffer needs writable memory (the interface marks it read-only)")
    stream = cai.stream
    if pool is None:
        source = getattr(obj, "buffer", obj)          # a BufferView's buffer
        pool = source.pool if isinstance(source, DeviceBuffer) else get_pool(device)
    buf = DeviceBuffer.__new__(DeviceBuffer)
    buf.pool = pool
    buf._ptr = cai.ptr
    buf.nbytes = cai.nbytes
    buf._stream = stream_key(0 if stream in (None, 1) else stream)
    buf._owner = obj
    return buf
