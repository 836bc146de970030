# cython: language_level=3, boundscheck=False, wraparound=False
"""The driver upstream: device memory from ``cuMemAlloc`` / ``cuMemFree``, exported for CUDA
IPC with ``cuIpcGetMemHandle``. Its device work (events, stream waits, copies) and the opening
of other processes' memory come from its bases (``gpupool.upstream.device``, ``driver_ipc``).
"""
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUdeviceptr, CUipcMemHandle, CU_IPC_HANDLE_SIZE
from gpupool.driver cimport calls as drv

from gpupool.errors import IpcError
from gpupool.upstream.base import IPC_MEM_HANDLE


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class DriverUpstream(DriverIpc):
    """DriverUpstream(device=0)
--

    Device memory from ``cuMemAlloc`` / ``cuMemFree`` on one device's primary context.

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

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef CUdeviceptr p = 0
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.mem_alloc(&p, nbytes))
        ptr[0] = <uintptr_t>p
        return r

    cdef int free(self, uintptr_t ptr) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.mem_free(<CUdeviceptr>ptr))

    # CUDA IPC export ------------------------------------------------------------------

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
        cdef int r = self.make_current(&prev)
        if r == 0:
            r = drv.mem_address_range(&found, &found_size, <CUdeviceptr>base)
            one = found == base and found_size >= size
            if r == 0 and one:
                r = drv.ipc_get_mem_handle(&handle, <CUdeviceptr>base)
            r = self.restore_current(prev, r)
        self.raise_error(r, "cuMemGetAddressRange / cuIpcGetMemHandle")
        if not one:
            raise IpcError(f"the segment at {base:#x} ({size} B) is not one cuMemAlloc "
                           f"allocation (cuMemGetAddressRange: {found_size} B at "
                           f"{<uintptr_t>found:#x})", "not_exportable")
        return (<char*>&handle)[:CU_IPC_HANDLE_SIZE]

    def __repr__(self):
        return f"DriverUpstream(device={self.device})"
