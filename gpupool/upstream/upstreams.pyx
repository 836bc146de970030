# cython: language_level=3, boundscheck=False, wraparound=False
"""Upstreams of the pool: the CUDA driver (cuMemAlloc/cuMemFree), the driver's stream-ordered
memory pool (cuMemAllocFromPoolAsync/cuMemFreeAsync) and Python-defined ones.

``DriverUpstream`` makes every call with its device's primary context current, so a block
freed on another thread, or with another device current, goes back with its own context.
``AsyncUpstream`` is a ``DriverUpstream`` whose memory comes from a driver memory pool of its
own. ``PythonUpstream`` forwards to Python methods; ``gpupool.testing.SimulatedDevice`` is one.
"""
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy
from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (
    CUresult, CUcontext, CUdevice, CUdeviceptr, CUstream, CUevent, CUmemoryPool,
    CUmemGenericAllocationHandle, CUipcMemHandle, CUipcEventHandle, CUDA_SUCCESS,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_PERMITTED, CU_IPC_HANDLE_SIZE,
)
from gpupool.driver cimport calls as drv

from gpupool.errors import GpupoolError, IpcError

# How an upstream's memory is exported for CUDA IPC (Upstream.ipc_kind).
IPC_MEM_HANDLE = "mem_handle"   # cuIpcGetMemHandle of a whole cuMemAlloc allocation
IPC_POSIX_FD = "posix_fd"       # cuMemExportToShareableHandle of each page, as file descriptors
cdef int POSIX_FD_SUPPORTED = (
    cydriver.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)

_ASYNC_REFUSAL = (
    "memory of a driver memory pool (upstream 'async': cuMemAllocFromPoolAsync) cannot be "
    "shared with another process: cuIpcGetMemHandle refuses it, and the pool was created "
    "without a shareable handle type (sharing it would take cuMemPoolExportToShareableHandle "
    "plus an export of every allocation, which gpupool does not do). Allocate the buffers you "
    "share from a pool on upstream 'vmm' (gpupool.Pool(upstream='vmm'), exported as POSIX "
    "file descriptors) or 'driver' (cuIpcGetMemHandle)")

# Per thread, the stream ID last seen for a few stream handles (see DriverUpstream.stream_id).
cdef extern from *:
    """
    #define GP_ID_CACHE 16
    struct gp_id_entry { uintptr_t handle; unsigned long long id; };
    static thread_local gp_id_entry gp_id_cache[GP_ID_CACHE];
    """
    int GP_ID_CACHE
    struct gp_id_entry:
        uintptr_t handle
        unsigned long long id
    gp_id_entry gp_id_cache[]


cdef class Upstream:
    """Base of the C-level upstream interface; not used directly.

    Attributes
    ----------
    device : int
        Device ordinal of its memory.
    stream_ordered : bool
        An allocation exists in its stream's order only: other streams must be ordered
        after it (``AsyncUpstream``).
    host_accessible : bool
        Its memory is host memory (the simulated device): DLPack exports it as kDLCPU.
    """

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
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

    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil:
        """The stream's process-unique ID (0: unknown); the pool keys streams by it."""
        out[0] = 0
        return 0

    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil:
        """Whether work on the stream is being captured into a CUDA graph
        (cuStreamIsCapturing): a device synchronize now would invalidate the capture."""
        out[0] = False
        return 0

    cdef int set_release_threshold(self, size_t nbytes) noexcept nogil:
        """Bytes of freed memory the upstream may keep for reuse (stream-ordered pools)."""
        return 0

    cdef int trim(self) noexcept nogil:
        """Give memory the upstream keeps after frees back to the device."""
        return 0

    # Expandable upstreams (expandable is true): address ranges whose pages are mapped.

    cdef int reserve(self, uintptr_t* va) noexcept nogil:
        """Reserve va_bytes of address space; its start goes to va."""
        return GP_PY_ERROR

    cdef int unreserve(self, uintptr_t va) noexcept nogil:
        """Give back a range from reserve (all its pages unmapped)."""
        return GP_PY_ERROR

    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Map new memory at va (whole pages of a reserved range), readable and writable by
        the device."""
        return GP_PY_ERROR

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Unmap whole pages and give their memory back (no queued work may use them)."""
        return GP_PY_ERROR

    cdef void clear_error(self) noexcept nogil:
        """Forget the exception of a failed call whose status the caller handles itself (a
        fallback): kept, its traceback would keep the caller's frames, and their buffers,
        alive."""
        pass

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

    # CUDA IPC (gpupool.ipc.share calls these; not the pool's hot path, so Python methods that a
    # Python upstream such as the simulated device overrides).

    @property
    def ipc_kind(self):
        """How this upstream's memory is exported for CUDA IPC: ``"mem_handle"`` (one
        ``cuIpcGetMemHandle`` per upstream allocation), ``"posix_fd"`` (one
        ``cuMemExportToShareableHandle`` file descriptor per page), or None (it cannot be:
        ``ipc_refusal`` says why)."""
        return None

    @property
    def ipc_refusal(self):
        """Why this upstream's memory cannot be exported (None when it can)."""
        return (f"{type(self).__name__} memory cannot be shared with another process (it "
                f"has no CUDA IPC export); allocate what you share from "
                f"gpupool.Pool(upstream='vmm') or gpupool.Pool(upstream='driver')")

    def _ipc_export(self, base, size):
        """Export the upstream allocation at ``base`` of ``size`` bytes (``ipc_kind``
        "mem_handle": the driver's handle, ``bytes``), or its pages (``"posix_fd"``: a list
        of new file descriptors, one per page, owned by the caller)."""
        raise IpcError(self.ipc_refusal, "not_exportable")

    def _ipc_open(self, kind, payload, size):
        """Map memory exported by another process (``kind`` and ``payload`` as
        ``_ipc_export`` gave them, the descriptors not consumed) of ``size`` bytes; returns
        its address here."""
        raise IpcError(f"{type(self).__name__} cannot open CUDA IPC handles", "open_failed")

    def _ipc_close(self, kind, address, size):
        """Unmap what ``_ipc_open`` mapped (the device's queued work is waited for first)."""
        raise IpcError(f"{type(self).__name__} cannot close CUDA IPC mappings", "open_failed")

    def _ipc_event_create(self):
        """An event another process can wait on; returns its handle (an int)."""
        raise IpcError(f"{type(self).__name__} has no IPC events", "not_exportable")

    def _ipc_event_record(self, event, stream):
        """Record ``event`` on stream handle ``stream``; returns its IPC handle (``bytes``)."""
        raise IpcError(f"{type(self).__name__} has no IPC events", "not_exportable")

    def _ipc_event_destroy(self, event):
        """Destroy an event of ``_ipc_event_create``."""

    def _ipc_wait(self, handle, stream):
        """Make stream handle ``stream`` wait for another process's event, given by its IPC
        handle (``bytes``; empty: nothing to wait for)."""
        raise IpcError(f"{type(self).__name__} cannot wait on IPC events", "open_failed")

    def _device_uuid(self):
        """The device's UUID (16 bytes), which names it in every process."""
        raise IpcError(f"{type(self).__name__} has no device UUID", "not_exportable")


cdef int _ipc_handle_from(object data, void* out, str what) except -1:
    """Copy a CUDA IPC handle (``CUipcMemHandle`` or ``CUipcEventHandle``: 64 bytes) from
    ``data`` into ``out``."""
    cdef const unsigned char[:] raw = bytes(data)
    if raw.shape[0] != CU_IPC_HANDLE_SIZE:
        raise IpcError(f"not a gpupool IPC handle: a CUDA IPC {what} handle has "
                       f"{CU_IPC_HANDLE_SIZE} bytes, not {raw.shape[0]}", "malformed")
    memcpy(out, &raw[0], CU_IPC_HANDLE_SIZE)
    return 0


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

    def __cinit__(self, device=0, *args, **kwargs):
        from gpupool.driver.ordinals import check_ordinal

        cdef CUdevice dev
        cdef CUcontext ctx
        cdef int count = 0
        device = check_ordinal(device)      # before cuInit, as Pool(device=) checks it
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

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
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

    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        out[0] = True
        if r == 0:
            r = self._leave(prev, drv.stream_is_capturing(<CUstream>stream, out))
        return r

    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil:
        # cuStreamGetId on a stream being captured into a graph fails and invalidates the
        # capture; a stream being captured is alive, so the ID this thread last saw for the
        # handle is still its ID (0, unknown, when there is none).
        cdef bint capturing = False
        cdef int r = drv.stream_is_capturing(<CUstream>stream, &capturing)
        cdef int slot = <int>((stream >> 4) % GP_ID_CACHE)
        out[0] = 0
        if r != 0:
            return r
        if capturing:
            if gp_id_cache[slot].handle == stream:
                out[0] = gp_id_cache[slot].id
            return 0
        r = drv.stream_get_id(<CUstream>stream, out)
        if r != 0:
            out[0] = 0
            return r
        gp_id_cache[slot].handle = stream
        gp_id_cache[slot].id = out[0]
        return 0

    # CUDA IPC -----------------------------------------------------------------------

    @property
    def ipc_kind(self):
        return IPC_MEM_HANDLE

    @property
    def ipc_refusal(self):
        return None

    def _ipc_export(self, uintptr_t base, size_t size):
        """The ``cuIpcGetMemHandle`` of the ``cuMemAlloc`` allocation at ``base`` (checked with
        ``cuMemGetAddressRange`` to be one allocation, starting there, of at least ``size``
        bytes), as 64 bytes."""
        cdef void* prev = NULL
        cdef CUdeviceptr found = 0
        cdef size_t found_size = 0
        cdef CUipcMemHandle handle
        cdef bint one = False
        cdef int r = self._enter(&prev)
        if r == 0:
            r = drv.mem_address_range(&found, &found_size, <CUdeviceptr>base)
            one = found == base and found_size >= size
            if r == 0 and one:
                r = drv.ipc_get_mem_handle(&handle, <CUdeviceptr>base)
            r = self._leave(prev, r)
        self.raise_error(r, "cuMemGetAddressRange / cuIpcGetMemHandle")
        if not one:
            raise IpcError(f"the segment at {base:#x} ({size} B) is not one cuMemAlloc "
                           f"allocation (cuMemGetAddressRange: {found_size} B at "
                           f"{<uintptr_t>found:#x})", "not_exportable")
        return (<char*>&handle)[:CU_IPC_HANDLE_SIZE]

    def _ipc_open(self, kind, payload, size_t size):
        cdef void* prev = NULL
        cdef CUdeviceptr ptr = 0
        cdef CUipcMemHandle handle
        cdef int r
        if kind == IPC_POSIX_FD:
            return self._ipc_open_pages(payload, size)
        _ipc_handle_from(payload, &handle, "memory")
        r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.ipc_open_mem_handle(&ptr, handle))
        self.raise_error(r, "cuIpcOpenMemHandle")
        return <uintptr_t>ptr

    def _ipc_open_pages(self, fds, size_t size):
        """Reserve ``size`` bytes of address space and map the pages of ``fds`` (each a
        ``cuMemExportToShareableHandle`` descriptor of one page of ``size // len(fds)``
        bytes) into it, readable and writable by this device."""
        cdef void* prev = NULL
        cdef CUdeviceptr va = 0
        cdef CUmemGenericAllocationHandle h = 0
        cdef size_t page, granularity = 0, done = 0, i
        cdef int r, fd
        if not fds or size % len(fds):
            raise IpcError(f"{len(fds)} page descriptors for {size} B", "malformed")
        page = size // len(fds)
        r = self._enter(&prev)
        if r != 0:
            self.raise_error(self._leave(prev, r), "cuCtxSetCurrent")
        try:
            r = drv.vmm_granularity(&granularity, self.device, True)
            if r == 0 and page % granularity:
                raise IpcError(f"pages of {page} B cannot be mapped on device {self.device}, "
                               f"whose granularity is {granularity} B", "wrong_device")
            if r == 0:
                r = drv.vmm_reserve(&va, size)
            for i in range(len(fds)):
                if r != 0:
                    break
                fd = fds[i]
                r = drv.vmm_import_fd(&h, fd)
                if r == 0:
                    r = drv.vmm_map(va + i * page, page, h)
                    drv.vmm_release(h)      # the mapping keeps the memory
                    if r == 0:
                        done += page
            if r == 0:
                r = drv.vmm_set_access(va, size, self.device)
            if r != 0 and va:
                if done:
                    drv.vmm_unmap(va, done)
                drv.vmm_free_range(va, size)
        finally:
            r = self._leave(prev, r)
        self.raise_error(r, "cuMemImportFromShareableHandle / cuMemMap")
        return <uintptr_t>va

    def _ipc_close(self, kind, uintptr_t address, size_t size):
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = drv.ctx_synchronize()       # no queued work may still read the mapping
            if r == 0 and kind == IPC_POSIX_FD:
                r = drv.vmm_unmap(<CUdeviceptr>address, size)
                if r == 0:
                    r = drv.vmm_free_range(<CUdeviceptr>address, size)
            elif r == 0:
                r = drv.ipc_close_mem_handle(<CUdeviceptr>address)
            r = self._leave(prev, r)
        self.raise_error(r, "cuIpcCloseMemHandle" if kind == IPC_MEM_HANDLE else "cuMemUnmap")

    def _ipc_event_create(self):
        cdef void* prev = NULL
        cdef CUevent e = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.ipc_event_create(&e))
        self.raise_error(r, "cuEventCreate(CU_EVENT_INTERPROCESS)")
        return <uintptr_t>e

    def _ipc_event_record(self, uintptr_t event, uintptr_t stream):
        cdef void* prev = NULL
        cdef CUipcEventHandle handle
        cdef int r = self._enter(&prev)
        if r == 0:
            r = drv.event_record(<CUevent>event, <CUstream>stream)
            if r == 0:
                r = drv.ipc_get_event_handle(&handle, <CUevent>event)
            r = self._leave(prev, r)
        self.raise_error(r, "cuEventRecord / cuIpcGetEventHandle")
        return (<char*>&handle)[:CU_IPC_HANDLE_SIZE]

    def _ipc_event_destroy(self, uintptr_t event):
        drv.event_destroy(<CUevent>event)

    def _ipc_wait(self, handle, uintptr_t stream):
        cdef void* prev = NULL
        cdef CUevent e = NULL
        cdef CUipcEventHandle raw_handle
        cdef int r
        if not handle:
            return
        _ipc_handle_from(handle, &raw_handle, "event")
        r = self._enter(&prev)
        if r == 0:
            r = drv.ipc_open_event_handle(&e, raw_handle)
            if r == 0:
                r = drv.stream_wait_event(<CUstream>stream, e)
                drv.event_destroy(e)        # the wait is queued; the event may go
            r = self._leave(prev, r)
        self.raise_error(r, "cuIpcOpenEventHandle / cuStreamWaitEvent")

    def _device_uuid(self):
        cdef unsigned char uuid[16]
        self.raise_error(drv.device_uuid(uuid, <CUdevice>self.device), "cuDeviceGetUuid")
        return bytes(uuid[:16])

    def __repr__(self):
        return f"DriverUpstream(device={self.device})"


cdef class AsyncUpstream(DriverUpstream):
    """Device memory from a driver memory pool of its own (``cuMemPoolCreate``), allocated
    with ``cuMemAllocFromPoolAsync`` on the requesting stream and freed with
    ``cuMemFreeAsync``.

    ``AsyncUpstream(device=0, release_threshold=0)``

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
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_pool_create(&pool, device))
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
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_alloc_from_pool(&p, nbytes,
                                                          <CUmemoryPool>self.mempool,
                                                          <CUstream>stream))
        ptr[0] = <uintptr_t>p
        return r

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        # The pool frees only blocks with no queued work (it synchronizes first when one
        # may have some), so the legacy stream is as good as the block's own.
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.mem_free_async(<CUdeviceptr>ptr, <CUstream>0))
        return r

    cdef int set_release_threshold(self, size_t nbytes) noexcept nogil:
        cdef int r = drv.mem_pool_set_release_threshold(<CUmemoryPool>self.mempool, nbytes)
        if r == 0:
            self.threshold = nbytes
        return r

    cdef int trim(self) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = drv.stream_synchronize(<CUstream>0)     # the frees above have run
            if r == 0:
                r = drv.mem_pool_trim_to(<CUmemoryPool>self.mempool, self.threshold)
            r = self._leave(prev, r)
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


cdef class VmmUpstream(DriverUpstream):
    """Device memory from the driver's virtual memory API, for expandable segments.

    ``VmmUpstream(device=0)``

    The pool reserves one range of address space per stream (``cuMemAddressReserve``, the
    device's memory in size) and maps pages into it as the stream's segment grows: each page
    is a physical allocation of its own (``cuMemCreate``; the granularity from
    ``cuMemGetAllocationGranularity``), mapped with ``cuMemMap`` and made readable and
    writable by the device with ``cuMemSetAccess``. A trim unmaps whole free pages
    (``cuMemUnmap``, ``cuMemRelease``) once the device's work on them is done.

    Pages are requested with the POSIX file descriptor handle type, so that buffers can be
    shared with other processes (``DeviceBuffer.ipc_handle``: one
    ``cuMemExportToShareableHandle`` descriptor per page). Where the device does not
    support it (``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``) or
    ``cuMemCreate`` refuses it (some containers and virtualized GPUs), pages are made
    without it: ``shareable`` is then False and ``ipc_refusal`` says why.

    Parameters
    ----------
    device : int
        Device ordinal.
    shareable : bool
        Request exportable pages (default); False never does.

    Raises
    ------
    NoDeviceError
        No driver, no device, or ``device`` out of range.
    CudaError
        The device has no virtual memory management, or the granularity query failed.
    """

    def __cinit__(self, int device=0, *args, shareable=True, **kwargs):
        cdef size_t granularity = 0, total = 0
        cdef int supported = 0
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0 and shareable:
            r = drv.device_attribute(&supported, POSIX_FD_SUPPORTED, <CUdevice>device)
            self.shareable = r == 0 and supported != 0
            if r == 0 and not supported:
                self.share_refused = CUDA_ERROR_NOT_SUPPORTED
            r = 0                           # an old driver without the attribute: not shared
        if r == 0:
            r = drv.vmm_granularity(&granularity, device, self.shareable)
            if r != 0 and self.shareable:   # the handle type refused: pages without it
                self.shareable, self.share_refused = False, r
                r = drv.vmm_granularity(&granularity, device, False)
            if r == 0:
                r = drv.device_total_mem(&total, <CUdevice>device)
            r = self._leave(prev, r)
        drv.check(<CUresult>r, "cuMemGetAllocationGranularity")
        self.expandable = True
        self.granularity = granularity
        self.va_bytes = (total + granularity - 1) // granularity * granularity

    cdef int reserve(self, uintptr_t* va) noexcept nogil:
        cdef void* prev = NULL
        cdef CUdeviceptr p = 0
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.vmm_reserve(&p, self.va_bytes))
        va[0] = <uintptr_t>p
        return r

    cdef int unreserve(self, uintptr_t va) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = self._leave(prev, drv.vmm_free_range(<CUdeviceptr>va, self.va_bytes))
        return r

    cdef void _release_pages(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef uintptr_t page = va
        while page < va + nbytes:
            if self.pages.count(page):
                drv.vmm_release(<CUmemGenericAllocationHandle>self.pages[page])
                self.pages.erase(page)
            page += self.granularity

    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef CUmemGenericAllocationHandle handle = 0
        cdef size_t done = 0, g = self.granularity
        cdef int r = self._enter(&prev)
        if r != 0:
            return r
        while done < nbytes and r == 0:
            r = drv.vmm_create(&handle, g, self.device, self.shareable)
            if r != 0 and self.shareable and r in (CUDA_ERROR_NOT_SUPPORTED,
                                                   CUDA_ERROR_INVALID_VALUE,
                                                   CUDA_ERROR_NOT_PERMITTED):
                # The platform refuses exportable memory: go on without it (ipc_refusal).
                self.shareable, self.share_refused = False, r
                r = drv.vmm_create(&handle, g, self.device, False)
            if r == 0:
                r = drv.vmm_map(<CUdeviceptr>(va + done), g, handle)
                if r != 0:
                    drv.vmm_release(handle)
                else:
                    self.pages[va + done] = handle
                    done += g
        if r == 0:
            r = drv.vmm_set_access(<CUdeviceptr>va, nbytes, self.device)
        if r != 0 and done:
            # Undo: nothing of a failed mapping stays mapped or allocated.
            drv.vmm_unmap(<CUdeviceptr>va, done)
            self._release_pages(va, done)
        return self._leave(prev, r)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self._enter(&prev)
        if r == 0:
            r = drv.vmm_unmap(<CUdeviceptr>va, nbytes)
            if r == 0:
                self._release_pages(va, nbytes)
            r = self._leave(prev, r)
        return r

    @property
    def mapped_bytes(self):
        """Bytes of device memory mapped now."""
        return self.pages.size() * self.granularity

    @property
    def ipc_kind(self):
        return IPC_POSIX_FD if self.shareable else None

    @property
    def ipc_refusal(self):
        if self.shareable:
            return None
        if self.share_refused == 0:
            why = "it was made with shareable=False"
        elif self.share_refused == CUDA_ERROR_NOT_SUPPORTED:
            why = ("the device does not support POSIX file descriptor handles "
                   "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)")
        else:
            from gpupool.driver.calls import error_name

            why = (f"the driver refused memory exportable as POSIX file descriptors "
                   f"(cuMemCreate: {error_name(self.share_refused)}; containers without "
                   f"the needed permissions and some virtualized GPUs do)")
        return (f"this pool's virtual-memory pages (upstream 'vmm') cannot be shared with "
                f"another process: {why}. Allocate what you share from "
                f"gpupool.Pool(upstream='driver') (cuIpcGetMemHandle), or set "
                f"GPUPOOL_UPSTREAM=driver")

    def _ipc_export(self, uintptr_t base, size_t size):
        """One new POSIX file descriptor (``cuMemExportToShareableHandle``) for each page of
        [base, base + size), in order; the caller owns them."""
        cdef uintptr_t page
        cdef int fd = -1, r = 0
        import os

        if not self.shareable:
            raise IpcError(self.ipc_refusal, "not_exportable")
        fds = []
        try:
            for page in range(base, base + size, self.granularity):
                if not self.pages.count(page):
                    raise IpcError(f"no page is mapped at {page:#x}", "not_exportable")
                r = drv.vmm_export_fd(&fd, <CUmemGenericAllocationHandle>self.pages[page])
                if r != 0:
                    self.raise_error(r, "cuMemExportToShareableHandle")
                fds.append(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def __repr__(self):
        return f"VmmUpstream(device={self.device}, granularity={self.granularity})"


cdef object _returned(Upstream upstream, str name, object value):
    """``value``, a PythonUpstream method's integer result, checked (a clear error instead of
    a float truncated to an address or a bare conversion error)."""
    if isinstance(value, bool) and name not in ("_event_query", "_stream_capturing") or \
            not hasattr(value, "__index__"):
        raise TypeError(f"{type(upstream).__name__}.{name} must return an int, got {value!r}")
    value = value.__index__()
    if not 0 <= value < 2**64:
        raise ValueError(f"{type(upstream).__name__}.{name} returned {value}, not an unsigned "
                         f"64-bit integer")
    return value


cdef class PythonUpstream(Upstream):
    """An upstream whose operations are Python methods; subclass it to simulate a device.

    A subclass defines ``_alloc(nbytes) -> int`` (raise ``MemoryError`` when out of memory;
    ``_alloc(nbytes, stream)`` once ``_set_stream_ordered(True)``),
    ``_free(ptr)``, ``_event_create() -> int``, ``_event_destroy(event)``,
    ``_event_record(event, stream)``, ``_event_query(event) -> bool``,
    ``_stream_wait_event(stream, event)``, ``_synchronize()``,
    ``_copy(kind, dst, src, nbytes, stream)`` (kind: 1 host to device, 2 device to host,
    3 device to device), ``_memset(dst, value, nbytes, stream)`` and
    ``_mem_info() -> (free, total)``, ``_stream_id(stream) -> int``, ``_trim()`` and
    ``_stream_capturing(stream) -> bool`` (optional: without it, never); an
    expandable one (``_set_expandable``) also ``_reserve() -> int``, ``_unreserve(va)``,
    ``_map(va, nbytes)`` (raise ``MemoryError`` when out of memory) and ``_unmap(va,
    nbytes)``. Exceptions other than ``MemoryError`` reach the caller of the pool operation
    that made the call.
    """

    cdef void clear_error(self) noexcept nogil:
        with gil:
            self._pending = None

    def _set_device(self, device):
        """Set the device ordinal this upstream reports (for subclasses' ``__init__``); an
        impossible one raises as ``Pool(device=)`` does (``gpupool.driver.ordinals``)."""
        from gpupool.driver.ordinals import check_ordinal

        self.device = check_ordinal(device)

    cdef int _call(self, str name, tuple args, uintptr_t* out, size_t* out2) noexcept:
        # Runs with the GIL. out/out2 receive the method's integer result(s) when given.
        try:
            result = getattr(self, name)(*args)
            if out2 != NULL:
                first, second = result
                out[0] = _returned(self, name, first)
                out2[0] = _returned(self, name, second)
            elif out != NULL:
                out[0] = _returned(self, name, result)
                if out[0] == 0 and name in ("_alloc", "_reserve"):
                    raise ValueError(f"{type(self).__name__}.{name} returned address 0")
        except BaseException as exc:
            if isinstance(exc, MemoryError):
                return CUDA_ERROR_OUT_OF_MEMORY
            self._pending = exc
            return GP_PY_ERROR
        return 0

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
        with gil:
            if self.stream_ordered:
                return self._call("_alloc", (nbytes, stream), ptr, NULL)
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

    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil:
        cdef uintptr_t sid = 0
        cdef int r = 0
        with gil:
            if hasattr(self, "_stream_id"):
                # On failure the exception stays pending: an allocation raises it
                # (Pool.checked_key); a free keys the stream by its handle alone.
                r = self._call("_stream_id", (stream,), &sid, NULL)
        out[0] = sid if r == 0 else 0
        return r

    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil:
        cdef uintptr_t answer = 0
        cdef int r = 0
        with gil:
            if hasattr(self, "_stream_capturing"):
                r = self._call("_stream_capturing", (stream,), &answer, NULL)
        out[0] = r != 0 or answer != 0
        return r

    cdef int trim(self) noexcept nogil:
        with gil:
            if not hasattr(self, "_trim"):
                return 0
            return self._call("_trim", (), NULL, NULL)

    def _set_stream_ordered(self, bint ordered):
        """Declare that ``_alloc(nbytes, stream)`` is ordered on ``stream`` (for subclasses)."""
        self.stream_ordered = ordered

    def _set_expandable(self, size_t granularity, size_t va_bytes):
        """Declare that memory comes as pages of ``granularity`` bytes mapped into ranges of
        ``va_bytes`` (``_reserve``, ``_map``, ``_unmap``, ``_unreserve``), for subclasses."""
        if granularity == 0 or granularity % 512 or va_bytes < granularity:
            raise ValueError("granularity must be a positive multiple of 512 B, no larger "
                             "than va_bytes")
        self.expandable = True
        self.granularity = granularity
        self.va_bytes = va_bytes

    cdef int reserve(self, uintptr_t* va) noexcept nogil:
        with gil:
            return self._call("_reserve", (), va, NULL)

    cdef int unreserve(self, uintptr_t va) noexcept nogil:
        with gil:
            return self._call("_unreserve", (va,), NULL, NULL)

    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil:
        with gil:
            return self._call("_map", (va, nbytes), NULL, NULL)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        with gil:
            return self._call("_unmap", (va, nbytes), NULL, NULL)

    def _set_host_accessible(self, bint accessible):
        """Declare that the memory ``_alloc`` returns is host memory (for subclasses): buffers
        then export DLPack as kDLCPU, so NumPy can read them."""
        self.host_accessible = accessible
