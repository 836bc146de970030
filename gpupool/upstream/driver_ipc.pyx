# cython: language_level=3, boundscheck=False, wraparound=False
"""CUDA IPC on a device, whatever its memory source: mapping memory another process exported
(a ``cuIpcGetMemHandle`` handle, or pages as POSIX file descriptors), unmapping it, and the
interprocess events that order the two processes' work. ``gpupool.ipc.share`` calls these;
the export of an upstream's own memory is its memory source's (``driver``, ``vmm``).
"""
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy
from cuda.bindings.cydriver cimport (
    CUdevice, CUdeviceptr, CUstream, CUevent, CUmemGenericAllocationHandle, CUipcMemHandle,
    CUipcEventHandle, CU_IPC_HANDLE_SIZE,
)
from gpupool.driver cimport calls as drv

from gpupool.errors import IpcError
from gpupool.upstream.base import IPC_MEM_HANDLE, IPC_POSIX_FD


cdef int _ipc_handle_from(object data, void* out, str what) except -1:
    """Copy a CUDA IPC handle (``CUipcMemHandle`` or ``CUipcEventHandle``: 64 bytes) from
    ``data`` into ``out``."""
    cdef const unsigned char[:] raw = bytes(data)
    if raw.shape[0] != CU_IPC_HANDLE_SIZE:
        raise IpcError(f"not a gpupool IPC handle: a CUDA IPC {what} handle has "
                       f"{CU_IPC_HANDLE_SIZE} bytes, not {raw.shape[0]}", "malformed")
    memcpy(out, &raw[0], CU_IPC_HANDLE_SIZE)
    return 0


cdef class DriverIpc(DriverDevice):
    """CUDA IPC on one device: the base of the driver upstreams, not used directly."""

    def _ipc_open(self, kind, payload, size_t size):
        cdef void* prev = NULL
        cdef CUdeviceptr ptr = 0
        cdef CUipcMemHandle handle
        cdef int r
        if kind == IPC_POSIX_FD:
            return self._ipc_open_pages(payload, size)
        _ipc_handle_from(payload, &handle, "memory")
        r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.ipc_open_mem_handle(&ptr, handle))
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
        r = self.make_current(&prev)
        if r != 0:
            self.raise_error(self.restore_current(prev, r), "cuCtxSetCurrent")
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
            r = self.restore_current(prev, r)
        self.raise_error(r, "cuMemImportFromShareableHandle / cuMemMap")
        return <uintptr_t>va

    def _ipc_close(self, kind, uintptr_t address, size_t size):
        cdef void* prev = NULL
        cdef int r = self.make_current(&prev)
        if r == 0:
            r = drv.ctx_synchronize()       # no queued work may still read the mapping
            if r == 0 and kind == IPC_POSIX_FD:
                r = drv.vmm_unmap(<CUdeviceptr>address, size)
                if r == 0:
                    r = drv.vmm_free_range(<CUdeviceptr>address, size)
            elif r == 0:
                r = drv.ipc_close_mem_handle(<CUdeviceptr>address)
            r = self.restore_current(prev, r)
        self.raise_error(r, "cuIpcCloseMemHandle" if kind == IPC_MEM_HANDLE else "cuMemUnmap")

    def _ipc_event_create(self):
        cdef void* prev = NULL
        cdef CUevent e = NULL
        cdef int r = self.make_current(&prev)
        r = r if r else self.restore_current(prev, drv.ipc_event_create(&e))
        self.raise_error(r, "cuEventCreate(CU_EVENT_INTERPROCESS)")
        return <uintptr_t>e

    def _ipc_event_record(self, uintptr_t event, uintptr_t stream):
        cdef void* prev = NULL
        cdef CUipcEventHandle handle
        cdef int r = self.make_current(&prev)
        if r == 0:
            r = drv.event_record(<CUevent>event, <CUstream>stream)
            if r == 0:
                r = drv.ipc_get_event_handle(&handle, <CUevent>event)
            r = self.restore_current(prev, r)
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
        r = self.make_current(&prev)
        if r == 0:
            r = drv.ipc_open_event_handle(&e, raw_handle)
            if r == 0:
                r = drv.stream_wait_event(<CUstream>stream, e)
                drv.event_destroy(e)        # the wait is queued; the event may go
            r = self.restore_current(prev, r)
        self.raise_error(r, "cuIpcOpenEventHandle / cuStreamWaitEvent")

    def _device_uuid(self):
        cdef unsigned char uuid[16]
        self.raise_error(drv.device_uuid(uuid, <CUdevice>self.device), "cuDeviceGetUuid")
        return bytes(uuid[:16])
