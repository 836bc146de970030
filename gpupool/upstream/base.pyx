# cython: language_level=3, boundscheck=False, wraparound=False
"""The upstream interface: where the pool's memory comes from, and the device work (events,
stream waits, copies) the pool orders around it.

``Upstream`` declares every operation with a default: a memory source overrides the memory
operations, a device the stream, event and copy operations. Each operation returns a status
code (0, a CUresult, or GP_PY_ERROR) and never raises, so the pool can call it under its lock;
``raise_error`` turns a code into the Python exception. The implementations, one a module:
``driver`` (cuMemAlloc), ``mempool`` (the driver's stream-ordered memory pool), ``vmm``
(virtual memory pages), ``python`` (Python methods, such as ``gpupool.testing.SimulatedDevice``).
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUresult, CUDA_ERROR_NOT_SUPPORTED
from gpupool.driver cimport calls as drv

from gpupool.errors import GpupoolError, IpcError

# How an upstream's memory is exported for CUDA IPC (Upstream.ipc_kind).
IPC_MEM_HANDLE = "mem_handle"   # cuIpcGetMemHandle of a whole cuMemAlloc allocation
IPC_POSIX_FD = "posix_fd"       # cuMemExportToShareableHandle of each page, as file descriptors


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class Upstream:
    """Upstream()
--

    Base of the C-level upstream interface; not used directly.

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

    # The memory source ----------------------------------------------------------------

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
        return GP_PY_ERROR

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        return GP_PY_ERROR

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
        """Map new memory at va (whole pages of a range from reserve), readable and writable by
        the device: each page a chunk of its own (unmapped one by one)."""
        return GP_PY_ERROR

    cdef int map_chunk(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Map new memory at va (whole pages of a range) as one chunk: one physical
        allocation, which an unmap gives back only whole (a tagged segment's memory)."""
        return self.map(va, nbytes)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Unmap the whole chunks that tile [va, va + nbytes) and give their memory back (no
        queued work may use them); a range that cuts a chunk is refused, nothing unmapped."""
        return GP_PY_ERROR

    # Device work: events, stream waits, copies, device queries -----------------------

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

    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil:
        """Host memory the device copies into and from at full speed (page-locked), for
        Pool.sleep's offload; CUDA_ERROR_NOT_SUPPORTED: none (the pool uses its own)."""
        return CUDA_ERROR_NOT_SUPPORTED

    cdef int host_free(self, uintptr_t ptr) noexcept nogil:
        """Give back host_alloc's memory."""
        return CUDA_ERROR_NOT_SUPPORTED

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

    # Status codes ---------------------------------------------------------------------

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
            exc, self.pending_error = self.pending_error, None
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
