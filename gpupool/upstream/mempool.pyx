# cython: language_level=3, boundscheck=False, wraparound=False
"""The stream-ordered upstream: device memory from a driver memory pool of its own
(``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``). Its memory has no CUDA IPC export.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUresult, CUdeviceptr, CUstream, CUmemoryPool
from gpupool.driver cimport calls as drv

from gpupool.errors import IpcError

_ASYNC_REFUSAL = (
    "memory of a driver memory pool (upstream 'async': cuMemAllocFromPoolAsync) cannot be "
    "shared with another process: cuIpcGetMemHandle refuses it, and the pool was created "
    "without a shareable handle type (sharing it would take cuMemPoolExportToShareableHandle "
    "plus an export of every allocation, which gpupool does not do). Allocate the buffers you "
    "share from a pool on upstream 'vmm' (gpupool.Pool(upstream='vmm'), exported as POSIX "
    "file descriptors) or 'driver' (cuIpcGetMemHandle)")


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class AsyncUpstream(DriverUpstream):
    """AsyncUpstream(device=0, release_threshold=0)
--

    Device memory from a driver memory pool of its own (``cuMemPoolCreate``), allocated
    with ``cuMemAllocFromPoolAsync`` on the requesting stream and freed with
    ``cuMemFreeAsync``.

    The gpupool pool over it keeps its own free lists as with ``DriverUpstream``; memory it
    gives back stays in the driver pool up to ``release_threshold`` bytes (the gpupool pool's
    soft limit, see ``Pool(upstream="async")``), where later growth finds it cheaply. A
    block is usable on its allocating stream at once; the pool orders other streams after
    the allocation with an event (``stream_ordered`` is true).

    Parameters
    ----------
    device : int
        Device ordinal.
    release_threshold : int
        Bytes of freed memory the driver pool keeps at synchronization points
        (``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``).

    Raises
    ------
    NoDeviceError
        No driver, no device, or ``device`` out of range.
    CudaError
        The device has no memory pool support, or ``cuMemPoolCreate`` failed.
    """

    def __cinit__(self, int device=0, release_threshold=0):
        cdef void* prev = NULL
        cdef CUmemoryPool pool = NULL
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.mem_pool_create(&pool, device))
        drv.check(<CUresult>r, "cuMemPoolCreate")
        self.mempool = <void*>pool
        self.stream_ordered = True
        self.raise_error(self.set_release_threshold(release_threshold),
                         "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")

    def __dealloc__(self):
        # Outstanding allocations keep the driver pool alive until they are freed.
        if self.mempool != NULL:
            drv.mem_pool_destroy(<CUmemoryPool>self.mempool)

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef CUdeviceptr p = 0
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.mem_alloc_from_pool(
                &p, nbytes, <CUmemoryPool>self.mempool, <CUstream>stream))
        ptr[0] = <uintptr_t>p
        return r

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        # The pool frees only blocks with no queued work (it synchronizes first when one
        # may have some), so the legacy stream is as good as the block's own.
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.mem_free_async(
                <CUdeviceptr>ptr, <CUstream>0))

    cdef int set_release_threshold(self, size_t nbytes) noexcept nogil:
        cdef int r = drv.mem_pool_set_release_threshold(<CUmemoryPool>self.mempool, nbytes)
        if r == 0:
            self.threshold = nbytes
        return r

    cdef int trim(self) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        if r == 0:
            r = drv.stream_synchronize(<CUstream>0)     # the frees above have run
            if r == 0:
                r = drv.mem_pool_trim_to(<CUmemoryPool>self.mempool, self.threshold)
            r = self.restore_current(prev, r)
        return r

    @property
    def release_threshold(self):
        """Bytes of freed memory the driver pool keeps (``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``)."""
        return self.threshold

    @property
    def ipc_kind(self):
        return None

    @property
    def ipc_refusal(self):
        return _ASYNC_REFUSAL

    def _ipc_export(self, base, size):
        raise IpcError(_ASYNC_REFUSAL, "not_exportable")

    def __repr__(self):
        return f"AsyncUpstream(device={self.device}, release_threshold={self.threshold})"
