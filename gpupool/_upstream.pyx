# cython: language_level=3, boundscheck=False, wraparound=False
"""Upstreams of the pool: the CUDA driver (cuMemAlloc/cuMemFree) and Python-defined ones.

``DriverUpstream`` makes every call with its device's primary context current, so a block
freed on another thread, or with another device current, goes back with its own context.
``PythonUpstream`` forwards to Python methods; ``gpupool.testing.SimulatedDevice`` is one.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport (
    CUresult, CUcontext, CUdevice, CUdeviceptr, CUstream, CUevent,
    CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_READY,
)
from gpupool cimport _driver as drv

from gpupool.errors import GpupoolError


cdef class Upstream:
    """Base of the C-level upstream interface; not used directly."""

    cdef int alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        return GP_PY_ERROR

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        return GP_PY_ERROR

    cdef int event_create(self, uintptr_t* event) noexcept nogil:
        return GP_PY_ERROR

    cdef int event_destroy(self, uintptr_t event) noexcept nogil:
        return GP_PY_ERROR

    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil:
        return GP_PY_ERROR

    cdef int event_query(self, uintptr_t event) noexcept nogil:
        return GP_PY_ERROR

    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil:
        return GP_PY_ERROR

    cdef int synchronize(self) noexcept nogil:
        return GP_PY_ERROR

    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
        return GP_PY_ERROR

    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil:
        return GP_PY_ERROR

    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil:
        return GP_PY_ERROR

    cdef int raise_error(self, int code, str what) except -1:
        """Raise the exception for a status code returned by one of the methods above."""
        if code == 0:
            return 0
        if code == GP_PY_ERROR:
            exc, self._pending = self._pending, None
            if exc is None:
                raise GpupoolError(f"{type(self).__name__} does not implement {what}")
            raise exc
        drv.check(<CUresult>code, what)
        return -1


cdef class DriverUpstream(Upstream):
    """Device memory from ``cuMemAlloc`` / ``cuMemFree`` on one device's primary context.

    Parameters
    ----------
    device : int
        Device ordinal.

    Raises
    ------
    NoDeviceError
        No driver, no device, or ``device`` out of range.
    CudaError
        Any other failure of ``cuInit`` or ``cuDevicePrimaryCtxRetain``.
    """

    def __cinit__(self, int device=0):
        cdef CUdevice dev
        cdef CUcontext ctx
        cdef int count = 0
        if device < 0:
            raise ValueError(f"device must be a non-negative ordinal, got {device}")
        drv.check(drv.init(), "cuInit")
        drv.check(drv.device_count(&count), "cuDeviceGetCount")
        if device >= count:
            from gpupool.errors import NoDeviceError
            raise NoDeviceError(f"no CUDA device {device}: this machine has {count}")
        drv.check(drv.device_get(&dev, device), "cuDeviceGet")
        drv.check(drv.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain")
        self.ctx = <void*>ctx
        self.retained = 1
        self.device = device

    def __dealloc__(self):
        # At interpreter shutdown the driver may already be gone: the result is ignored.
        if self.retained:
            drv.primary_ctx_release(<CUdevice>self.device)

    # Each call that needs a context runs with ours current and restores the caller's.
    cdef int _enter(self, void** previous) noexcept nogil:
        cdef CUresult r = drv.ctx_get_current(<CUcontext*>previous)
        if r != CUDA_SUCCESS:
            return r
        if previous[0] != self.ctx:
            return drv.ctx_set_current(<CUcontext>self.ctx)
        return 0

    cdef int _leave(self, void* previous, int result) noexcept nogil:
        cdef CUresult r = CUDA_SUCCESS
        if previous != self.ctx:
            r = drv.ctx_set_current(<CUcontext>previous)
        return result if result != 0 else r

    cdef int alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef CUdeviceptr p = 0
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_alloc(&p, nbytes))
        ptr[0] = <uintptr_t>p
        return r

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_free(<CUdeviceptr>ptr))
        return r

    cdef int event_create(self, uintptr_t* event) noexcept nogil:
        cdef void* prev = NULL
        cdef CUevent e = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.event_create(&e))
        event[0] = <uintptr_t>e
        return r

    cdef int event_destroy(self, uintptr_t event) noexcept nogil:
        return drv.event_destroy(<CUevent>event)

    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.event_record(<CUevent>event, <CUstream>stream))
        return r

    cdef int event_query(self, uintptr_t event) noexcept nogil:
        return drv.event_query(<CUevent>event)

    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.stream_wait_event(<CUstream>stream, <CUevent>event))
        return r

    cdef int synchronize(self) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.ctx_synchronize())
        return r

    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        cdef CUstream s = <CUstream>stream
        if r != 0:
            return r
        if kind == HOST_TO_DEVICE:
            r = drv.memcpy_htod(<CUdeviceptr>dst, <const void*>src, nbytes, s)
        elif kind == DEVICE_TO_HOST:
            # Pageable destination: the copy has completed when the call returns, but the
            # stream is synchronized too, so pinned destinations are equally safe to read.
            r = drv.memcpy_dtoh(<void*>dst, <CUdeviceptr>src, nbytes, s)
            if r == 0:
                r = drv.stream_synchronize(s)
        else:
            r = drv.memcpy_dtod(<CUdeviceptr>dst, <CUdeviceptr>src, nbytes, s)
        return self._leave(prev, r)

    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.memset_d8(<CUdeviceptr>dst, value, nbytes,
                                                <CUstream>stream))
        return r

    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_get_info(free, total))
        return r

    def __repr__(self):
        return f"DriverUpstream(device={self.device})"


cdef class PythonUpstream(Upstream):
    """An upstream whose operations are Python methods; subclass it to simulate a device.

    A subclass defines ``_alloc(nbytes) -> int`` (raise ``MemoryError`` when out of memory),
    ``_free(ptr)``, ``_event_create() -> int``, ``_event_destroy(event)``,
    ``_event_record(event, stream)``, ``_event_query(event) -> bool``,
    ``_stream_wait_event(stream, event)``, ``_synchronize()``,
    ``_copy(kind, dst, src, nbytes, stream)`` (kind: 1 host to device, 2 device to host,
    3 device to device), ``_memset(dst, value, nbytes, stream)`` and
    ``_mem_info() -> (free, total)``. Exceptions other than ``MemoryError`` reach the caller
    of the pool operation that made the call.
    """

    def _set_device(self, int device):
        """Set the device ordinal this upstream reports (for subclasses' ``__init__``)."""
        if device < 0:
            raise ValueError(f"device must be a non-negative ordinal, got {device}")
        self.device = device

    cdef int _call(self, str name, tuple args, uintptr_t* out, size_t* out2) noexcept:
        # Runs with the GIL. out/out2 receive the method's integer result(s) when given.
        try:
            result = getattr(self, name)(*args)
            if out2 != NULL:
                out[0], out2[0] = result
            elif out != NULL:
                out[0] = result
        except BaseException as exc:
            if isinstance(exc, MemoryError):
                return CUDA_ERROR_OUT_OF_MEMORY
            self._pending = exc
            return GP_PY_ERROR
        return 0

    cdef int alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        with gil:
            return self._call("_alloc", (nbytes,), ptr, NULL)

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        with gil:
            return self._call("_free", (ptr,), NULL, NULL)

    cdef int event_create(self, uintptr_t* event) noexcept nogil:
        with gil:
            return self._call("_event_create", (), event, NULL)

    cdef int event_destroy(self, uintptr_t event) noexcept nogil:
        with gil:
            return self._call("_event_destroy", (event,), NULL, NULL)

    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_event_record", (event, stream), NULL, NULL)

    cdef int event_query(self, uintptr_t event) noexcept nogil:
        cdef uintptr_t done = 0
        cdef int r
        with gil:
            r = self._call("_event_query", (event,), &done, NULL)
        if r == 0 and not done:
            return CUDA_ERROR_NOT_READY
        return r

    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil:
        with gil:
            return self._call("_stream_wait_event", (stream, event), NULL, NULL)

    cdef int synchronize(self) noexcept nogil:
        with gil:
            return self._call("_synchronize", (), NULL, NULL)

    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_copy", (<int>kind, dst, src, nbytes, stream), NULL, NULL)

    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil:
        with gil:
            return self._call("_memset", (dst, value, nbytes, stream), NULL, NULL)

    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil:
        cdef uintptr_t f = 0
        with gil:
            r = self._call("_mem_info", (), &f, total)
        free[0] = f
        return r
