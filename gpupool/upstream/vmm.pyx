# cython: language_level=3, boundscheck=False, wraparound=False
"""The virtual-memory upstream: device memory as pages (``cuMemCreate``) mapped into reserved
ranges of address space, for expandable segments; its pages export for CUDA IPC as POSIX file
descriptors (``cuMemExportToShareableHandle``), one per page.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (
    CUresult, CUdevice, CUdeviceptr, CUmemGenericAllocationHandle, CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_PERMITTED,
)
from gpupool.driver cimport calls as drv

from gpupool.errors import IpcError
from gpupool.upstream.base import IPC_POSIX_FD

cdef int POSIX_FD_SUPPORTED = (
    cydriver.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)


# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class VmmUpstream(DriverUpstream):
    """VmmUpstream(device=0, *, shareable=True)
--

    Device memory from the driver's virtual memory API, for expandable segments.

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
        cdef int r = self.make_current(&prev)
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
            r = self.restore_current(prev, r)
        drv.check(<CUresult>r, "cuMemGetAllocationGranularity")
        self.expandable = True
        self.granularity = granularity
        self.va_bytes = (total + granularity - 1) // granularity * granularity

    cdef int reserve(self, uintptr_t* va) noexcept nogil:
        cdef void* prev = NULL
        cdef CUdeviceptr p = 0
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.vmm_reserve(&p, self.va_bytes))
        va[0] = <uintptr_t>p
        return r

    cdef int unreserve(self, uintptr_t va) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        return r if r else self.restore_current(prev, drv.vmm_free_range(
                <CUdeviceptr>va, self.va_bytes))

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
        cdef int r = self.make_current(&prev)
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
        return self.restore_current(prev, r)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        if r == 0:
            r = drv.vmm_unmap(<CUdeviceptr>va, nbytes)
            if r == 0:
                self._release_pages(va, nbytes)
            r = self.restore_current(prev, r)
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
