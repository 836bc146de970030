"""Simulated CUDA IPC (``SimulatedDevice(shareable=True)``): memory other processes can map
(``memfd`` files mapped shared, one per allocation or, with virtual memory, per page), its
export and opening, and interprocess events."""

import fcntl
import mmap
import os

from gpupool.errors import IpcError
from gpupool.simulated.base import SimulatedBase
from gpupool.simulated.failures import CUDA_ERROR_INVALID_VALUE, cuda_error
from gpupool.simulated.host import MAP_FIXED, MAP_NORESERVE, libc, map_rw


class SimulatedSharing(SimulatedBase):
    """The shareable memory and the IPC calls of a ``SimulatedDevice``. It reads the size of
    an allocation from the device (``_allocation_bytes``) and takes event handles from its
    streams (``_new_handle``, ``_check_stream``)."""

    def _init_sharing(self, shareable, uuid):
        self.shareable = bool(shareable)
        self._uuid = uuid
        self._shared = {}               # shareable: pointer -> (memfd, bytes mapped)
        self._page_fds = {}             # shareable virtual memory: page -> its memfd
        self._opened = {}               # another process's memory mapped here: address ->
                                        # (memfd or None, bytes, handle payload or None)

    # Shareable memory ------------------------------------------------------------------

    def _shared_alloc(self, nbytes):
        """Host memory another process can map: a memfd mapped shared (page aligned)."""
        length = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("gpupool-simulated", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, length)
            ptr = map_rw(None, length, mmap.MAP_SHARED, fd)
        except BaseException:
            os.close(fd)
            raise
        self._shared[ptr] = (fd, length)
        return ptr

    def _shared_free(self, ptr, nbytes):
        """Unmap and close the memfd of the allocation at ``ptr`` (``nbytes``), if it is one."""
        if ptr in self._shared:
            fd, length = self._shared.pop(ptr)
            if not _unlocked(fd):
                # Not raised: the pool frees without looking at the result (trim).
                self.errors.append(f"free of {nbytes} B at {ptr:#x} while another process holds "
                                   f"it open (cuMemFree of memory opened with "
                                   f"cuIpcOpenMemHandle elsewhere is undefined on a GPU)")
            libc.munmap(ptr, length)
            os.close(fd)

    def _share_pages(self, pages):
        """Map a memfd of its own at each page start of ``pages``, as cuMemCreate makes each
        page an allocation of its own."""
        for p in pages:
            fd = os.memfd_create("gpupool-simulated-page", os.MFD_CLOEXEC)
            os.ftruncate(fd, self.page)
            map_rw(p, self.page, mmap.MAP_SHARED | MAP_FIXED, fd)
            self._page_fds[p] = fd

    def _unshare_pages(self, va, nbytes, pages):
        """Put the reservation's anonymous memory back at [va, va + nbytes) and close the
        memfds of its ``pages``."""
        map_rw(va, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED)
        for p in pages:
            os.close(self._page_fds.pop(p))

    # CUDA IPC (shareable=True) ----------------------------------------------------------

    @property
    def ipc_kind(self):
        if not self.shareable:
            return None
        return "posix_fd" if self.expandable else "mem_handle"

    @property
    def ipc_refusal(self):
        if self.shareable:
            return None
        return ("a SimulatedDevice made without shareable=True serves private host memory, "
                "which no other process can map: make it with "
                "SimulatedDevice(shareable=True) to simulate CUDA IPC")

    def _ipc_export(self, base, size):
        self._called("ipc_export", (base, size))
        if not self.shareable:
            raise IpcError(self.ipc_refusal, "not_exportable")
        if self.expandable:
            pages = range(base, base + size, self.page)
            if any(p not in self._page_fds for p in pages):
                self._misuse(f"export of {size} B at {base:#x}: a page is not mapped")
            if any(self._mapped_chunks.get(p) != self.page for p in pages):
                raise IpcError(f"no page is mapped at {base:#x} on its own: a tag's memory "
                               f"(gpupool.tag) is mapped in chunks of many pages, which are "
                               f"not exported; allocate what you share outside a tag",
                               "not_exportable")
            return [os.dup(self._page_fds[p]) for p in pages]
        if base not in self._shared or self._allocation_bytes(base) != size:
            self._misuse(f"export of {size} B at {base:#x}: not one allocation")
        fd = self._shared[base][0]
        return f"{os.getpid()}:{fd}:{os.fstat(fd).st_ino}".encode()

    def _ipc_open(self, kind, payload, size):
        self._called("ipc_open", (kind, size))
        if kind == "posix_fd":
            page = size // len(payload)
            va = map_rw(None, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
            for i, fd in enumerate(payload):
                map_rw(va + i * page, page, mmap.MAP_SHARED | MAP_FIXED, fd)
            self._opened[va] = (None, size, None)
            return va
        if any(key == payload for _, _, key in self._opened.values()):
            self._misuse("cuIpcOpenMemHandle of a handle already open in this process (the "
                         "driver maps an allocation once per process)")
        pid, fd, inode = (int(x) for x in bytes(payload).decode().split(":"))
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            raise _invalid_value(f"no allocation of process {pid} is behind the handle") \
                from None
        if os.fstat(mine).st_ino != inode:
            os.close(mine)
            raise _invalid_value(f"the allocation of process {pid} behind the handle was freed")
        fcntl.flock(mine, fcntl.LOCK_SH)    # what the exporter's free looks for
        try:
            va = map_rw(None, size, mmap.MAP_SHARED, mine)
        except BaseException:
            os.close(mine)
            raise
        self._opened[va] = (mine, size, bytes(payload))
        return va

    def _ipc_close(self, kind, address, size):
        self._called("ipc_close", (kind, size))
        if address not in self._opened:
            self._misuse(f"close of {address:#x}, which no IPC open mapped")
        fd, length, _ = self._opened.pop(address)
        libc.munmap(address, length)
        if fd is not None:
            os.close(fd)

    def _ipc_event_create(self):
        event = self._new_handle()
        self._called("ipc_event_create", (event,))
        return event

    def _ipc_event_record(self, event, stream):
        self._called("ipc_event_record", (event, stream))
        self._check_stream(stream)
        # Simulated work is done when a host copy returns: nothing to wait for elsewhere.
        return f"simulated-event-{os.getpid()}-{event}".encode()

    def _ipc_event_destroy(self, event):
        self._called("ipc_event_destroy", (event,))

    def _ipc_wait(self, handle, stream):
        self._called("ipc_wait", (bytes(handle), stream))
        self._check_stream(stream)

    def _device_uuid(self):
        return self._uuid


def _unlocked(fd):
    """Whether no other process holds a lock on fd's file (an importer's mapping)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _invalid_value(why):
    return cuda_error(CUDA_ERROR_INVALID_VALUE, f"simulated device: {why}")
