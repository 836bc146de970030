# cython: language_level=3, boundscheck=False, wraparound=False
"""The virtual-memory upstream: device memory as pages (``cuMemCreate``) mapped into reserved
ranges of address space, for expandable segments; its pages export for CUDA IPC as POSIX file
descriptors (``cuMemExportToShareableHandle``), one per page; a tagged segment's chunks of
many pages are not exported.
"""
from libc.stdint cimport uintptr_t
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from cython.operator cimport dereference as deref
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
    (``cuMemUnmap``, ``cuMemRelease``) once the device's work on them is done. A tagged
    segment (``gpupool.tag``) maps each growth, and a wake its whole range, as one chunk: one
    physical allocation of many pages, unmapped only whole (Note [Sleep and wake]).

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

    Attributes
    ----------
    release_refused : int
        The CUresult of the last ``cuMemRelease`` the driver refused after an unmap (0:
        none); that memory stays with the driver, the range is unmapped all the same.

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

    cdef int _create(self, CUmemGenericAllocationHandle* handle, size_t nbytes) noexcept nogil:
        """cuMemCreate of nbytes (whole pages) on the device, exportable while shareable."""
        cdef int r = drv.vmm_create(handle, nbytes, self.device, self.shareable)
        if r != 0 and self.shareable and r in (CUDA_ERROR_NOT_SUPPORTED,
                                               CUDA_ERROR_INVALID_VALUE,
                                               CUDA_ERROR_NOT_PERMITTED):
            # The platform refuses exportable memory: go on without it (ipc_refusal).
            self.shareable, self.share_refused = False, r
            r = drv.vmm_create(handle, nbytes, self.device, False)
        return r

    cdef int _map_one(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """With the device's context current: one chunk of nbytes created and mapped at va
        (access is the caller's), recorded in chunks; on failure nothing is left of it."""
        cdef CUmemGenericAllocationHandle handle = 0
        cdef Chunk chunk
        cdef int r = self._create(&handle, nbytes)
        if r != 0:
            return r
        r = drv.vmm_map(<CUdeviceptr>va, nbytes, handle)
        if r != 0:
            self._release(handle)
            return r
        chunk.handle, chunk.nbytes = <unsigned long long>handle, nbytes
        self.chunks[va] = chunk
        self.mapped += nbytes
        return 0

    cdef void _undo(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Undo a map that failed after its chunks in [va, va + nbytes) were mapped: nothing
        of it stays allocated (should the unmap fail too, the handles go all the same: the
        memory then stays with the mapping, and the range is no longer given back)."""
        drv.vmm_unmap(<CUdeviceptr>va, nbytes)      # (the map's failure is what is reported)
        self._release_chunks(va, nbytes)

    cdef bint _whole_chunks(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Whether chunks tile [va, va + nbytes) exactly: cuMemUnmap cannot unmap part of a
        mapping, so an unmap must take every chunk it touches whole."""
        cdef unordered_map[uintptr_t, Chunk].iterator it
        cdef uintptr_t p = va
        while p < va + nbytes:
            it = self.chunks.find(p)
            if it == self.chunks.end():
                return False
            p += deref(it).second.nbytes
        return p == va + nbytes

    cdef void _release_chunks(self, uintptr_t va, size_t nbytes) noexcept nogil:
        """Release (cuMemRelease) and forget the chunks that start in [va, va + nbytes)."""
        cdef unordered_map[uintptr_t, Chunk].iterator it
        cdef uintptr_t p = va
        while p < va + nbytes:
            it = self.chunks.find(p)
            if it == self.chunks.end():
                p += self.granularity
                continue
            self._release(<CUmemGenericAllocationHandle>deref(it).second.handle)
            p += deref(it).second.nbytes
            self.mapped -= deref(it).second.nbytes
            self.chunks.erase(it)

    cdef void _release(self, CUmemGenericAllocationHandle handle) noexcept nogil:
        """cuMemRelease of an unmapped (or never mapped) handle. A refusal is kept in
        release_refused: the mapping is gone either way, so the pool's view stays right."""
        cdef int r = drv.vmm_release(handle)
        if r != 0:
            self.release_refused = r

    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef size_t done = 0, g = self.granularity
        cdef int r = self.make_current(&prev)
        if r != 0:
            return r
        while done < nbytes and r == 0:
            r = self._map_one(va + done, g)        # one chunk a page: trims unmap pages
            if r == 0:
                done += g
        if r == 0:
            r = drv.vmm_set_access(<CUdeviceptr>va, nbytes, self.device)
        if r != 0 and done:
            self._undo(va, done)
        return self.restore_current(prev, r)

    cdef int map_chunk(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        if r != 0:
            return r
        r = self._map_one(va, nbytes)
        if r == 0:
            r = drv.vmm_set_access(<CUdeviceptr>va, nbytes, self.device)
            if r != 0:
                self._undo(va, nbytes)
        return self.restore_current(prev, r)

    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil:
        cdef void* prev = NULL
        cdef int r
        if not self._whole_chunks(va, nbytes):
            return CUDA_ERROR_INVALID_VALUE     # (the pool never asks: _verify checks it)
        r = self.make_current(&prev)
        if r == 0:
            r = drv.vmm_unmap(<CUdeviceptr>va, nbytes)
            if r == 0:
                self._release_chunks(va, nbytes)
            r = self.restore_current(prev, r)
        return r

    def _chunks(self, uintptr_t va, size_t nbytes):
        """The chunks mapped in [va, va + nbytes) or across its ends: ``(start, bytes)`` by
        address, for the pool's consistency check."""
        cdef pair[uintptr_t, Chunk] item
        found = []
        for item in self.chunks:
            if item.first < va + nbytes and item.first + item.second.nbytes > va:
                found.append((item.first, item.second.nbytes))
        return sorted(found)

    @property
    def mapped_bytes(self):
        """Bytes of device memory mapped now."""
        return self.mapped

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
        cdef unordered_map[uintptr_t, Chunk].iterator it
        cdef int fd = -1, r = 0
        import os

        if not self.shareable:
            raise IpcError(self.ipc_refusal, "not_exportable")
        fds = []
        try:
            for page in range(base, base + size, self.granularity):
                it = self.chunks.find(page)
                if it == self.chunks.end() or deref(it).second.nbytes != self.granularity:
                    raise IpcError(
                        f"no page is mapped at {page:#x} on its own: a tag's memory "
                        f"(gpupool.tag) is mapped in chunks of many pages, which are not "
                        f"exported; allocate what you share outside a tag", "not_exportable")
                r = drv.vmm_export_fd(&fd, <CUmemGenericAllocationHandle>deref(it).second.handle)
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
