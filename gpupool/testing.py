"""A simulated device: the pool's upstream on machines without a GPU.

``SimulatedDevice`` serves host memory (256-byte aligned) and simulates streams, events and
pending work, so every policy of the pool (size classes, stream-ordered reuse, limits,
regions) runs and is tested on CPU, in gpupool's CI and in yours::

    from gpupool.testing import SimulatedDevice
    sim = SimulatedDevice(capacity=1 << 30)
    pool = gpupool.Pool(upstream=sim)
    s = sim.create_stream()
    sim.launch(s)          # work still running on s
    sim.complete(s)        # ... now finished

Every simulated driver call is appended to ``sim.calls`` as ``(name, args)``.

``SimulatedDevice(shareable=True)`` simulates CUDA IPC with memory that other processes can
map: allocations (and, with ``virtual_memory``, pages) are ``memfd`` files mapped shared, so a
buffer's ``ipc_handle()`` opens with ``gpupool.open_ipc`` in another process on a pool of its
own simulated device, and both see the same bytes.
"""

import ctypes
import fcntl
import itertools
import mmap
import os
import threading

import numpy as np

from gpupool.upstream.python import PythonUpstream
from gpupool.errors import CudaError, IpcError
from gpupool.limits import parse_limit

__all__ = ["SimulatedDevice"]

ALIGNMENT = 256
LEGACY_STREAM = 0
PER_THREAD_STREAM = 2
PAGE_BYTES = 2 << 20                    # the driver's page (cuMemAlloc rounds to it)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_MADV_DONTNEED = 4
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class SimulatedDevice(PythonUpstream):
    """Host memory with simulated streams and events, usable as a ``Pool`` upstream.

    Parameters
    ----------
    capacity : int or str
        Bytes the device holds, as an int or a size string as for the pool's limits
        (``"1GiB"``, ``"512MB"``; not a percentage); an allocation beyond it fails as out of
        memory.
    device : int
        Ordinal reported as the pool's device.
    stream_ordered : bool
        Simulate a stream-ordered upstream (as ``gpupool.AsyncUpstream``): each allocation
        is work queued on the requesting stream, and memory exists for other streams only
        once that work is done or ordered before theirs.
    virtual_memory : bool
        Simulate the driver's virtual memory API (as ``gpupool.VmmUpstream``): the pool
        reserves ranges of address space (``capacity`` bytes each, host address space that
        costs nothing until used) and maps pages of ``page`` bytes into them as it grows.
        Unmapping a page while any stream has work pending is a misuse (the pool must order
        an unmap after the work that may use the page).
    page : int or str
        Bytes of a page (a multiple of 512; ``"2MiB"`` as for ``capacity``): the mapping
        granularity with ``virtual_memory``; without it, the rounding of allocations that
        ``device_bytes`` counts (cuMemAlloc maps whole 2 MiB pages).
    shareable : bool
        Simulate CUDA IPC (``DeviceBuffer.ipc_handle``, ``gpupool.open_ipc``) with memory
        other processes can map: each allocation is a ``memfd`` file mapped shared, which
        exports as a "mem_handle" handle (as ``cuIpcGetMemHandle`` on upstream "driver");
        with ``virtual_memory`` each page is one, exported as a file descriptor per page
        ("posix_fd", as upstream "vmm"). Freeing an allocation that another process holds
        open is a misuse (``errors``), as ``cuMemFree`` of it is undefined on a GPU, and so is
        opening one allocation twice in a process (the driver refuses it). Not with
        ``stream_ordered`` (as upstream "async", whose memory is not exportable).
    uuid : bytes, optional
        The 16-byte device UUID IPC handles carry (default: one per ``device`` ordinal, the
        same in every process): another value simulates another GPU.

    Raises
    ------
    ValueError, TypeError
        A capacity or page that is not a positive size (``gpupool.limits.parse_limit``), a
        page that is not a multiple of 512 B (of the host's page with ``shareable`` and
        ``virtual_memory``), an impossible device (negative, not an int), ``shareable`` with
        ``stream_ordered``, or a ``uuid`` that is not 16 bytes.

    Notes
    -----
    Streams follow the driver's rules where the pool relies on them. The per-thread default
    stream (handle 2) is one stream per thread: handle 2 names the calling thread's
    (``per_thread_stream`` names another thread's for ``ordered``, ``pending``,
    ``complete`` and ``queued``). The per-thread streams are blocking streams, created streams
    are non-blocking (as ``cupy.cuda.Stream(non_blocking=True)``): the legacy default stream
    synchronizes with the blocking streams, so an event recorded on the legacy stream also
    covers the work queued so far on every thread's per-thread stream, an event recorded on a
    per-thread stream covers the legacy stream's, and new work on one of them runs after
    earlier work on the other.

    Attributes
    ----------
    calls : list of (str, tuple)
        Every simulated driver call, in order: ``alloc``, ``free``, ``event_create``,
        ``event_destroy``, ``event_record``, ``event_query``, ``stream_wait_event``,
        ``synchronize``, ``copy``, ``memset``, ``mem_info``, ``trim``, ``stream_capturing``;
        with ``virtual_memory``, ``reserve``, ``unreserve``, ``map``, ``unmap``. With
        ``stream_ordered``, ``alloc``'s arguments are ``(nbytes, stream)``.
    used : int
        Bytes currently allocated (or mapped).
    device_bytes, peak_device_bytes : int
        The device memory that would be in use, now and at the most: allocations rounded
        up to ``page`` (mapped pages with ``virtual_memory``); what ``cuMemGetInfo`` would
        count.
    capturing : set of int
        Handles of the streams a test says are being captured into a CUDA graph (empty at
        first): ``stream_capturing`` reports them, and a ``synchronize`` meanwhile is a
        misuse (it would invalidate the capture).
    errors : list of str
        Misuses seen (a call on an unknown or destroyed stream, a free of an unknown pointer):
        each also raises, but a pool freeing from ``__dealloc__`` cannot report it, so tests
        should check that this list is empty.
    """

    def __init__(self, capacity=1 << 30, device=0, stream_ordered=False, virtual_memory=False,
                 page=PAGE_BYTES, shareable=False, uuid=None):
        self._set_device(device)            # first: an impossible device is refused first
        capacity = parse_limit(capacity, _no_total, "capacity")
        page = parse_limit(page, _no_total, "page")
        if page % 512:
            raise ValueError(f"page must be a positive multiple of 512 B, got {page}")
        if shareable and stream_ordered:
            raise ValueError("a stream-ordered simulated device (as upstream 'async') cannot "
                             "be shareable: that memory has no IPC export")
        if shareable and virtual_memory and page % mmap.PAGESIZE:
            raise ValueError(f"shareable virtual memory maps whole host pages: page must be a "
                             f"multiple of {mmap.PAGESIZE} B, got {page}")
        if uuid is None:
            uuid = b"gpupool-simdev" + int(device).to_bytes(2, "little")
        if not (isinstance(uuid, bytes) and len(uuid) == 16):
            raise ValueError(f"uuid must be 16 bytes, got {uuid!r}")
        self.shareable = bool(shareable)
        self._uuid = uuid
        self._shared = {}               # shareable: pointer -> (memfd, bytes mapped)
        self._page_fds = {}             # shareable virtual memory: page -> its memfd
        self._opened = {}               # another process's memory mapped here: address ->
                                        # (memfd or None, bytes, handle payload or None)
        self._set_stream_ordered(stream_ordered)
        self._set_host_accessible(True)     # buffers export DLPack as kDLCPU: NumPy reads them
        self.capacity = capacity
        self.page = page
        if virtual_memory:
            self._set_expandable(self.page, -(-self.capacity // self.page) * self.page)
        self._ranges = {}               # reserved start -> (bytes, set of mapped page starts)
        self.used = self.device_bytes = self.peak_device_bytes = 0
        self.calls = []
        self.errors = []
        self.capturing = set()
        self._arrays = {}               # pointer -> (numpy array holding it, nbytes)
        self._handles = itertools.count(0x1000, 0x10)
        # Work on a stream is numbered; `done` is the last finished number, `queued` the last.
        # Streams are keyed by handle; a thread's per-thread stream by (2, thread ident), made
        # on first use (_key).
        self._queued = {LEGACY_STREAM: 0}
        self._done = {LEGACY_STREAM: 0}
        self._events = {}               # event -> list of (stream, work number) it waits for
        self._waits = {}                # stream -> events its later work waits for
        self._ids = itertools.count(1)
        self._stream_ids = {}           # stream -> ID, new for every created stream
        self.allocated_on = {}          # stream-ordered: pointer -> (stream, work number)

    # The test-facing side --------------------------------------------------------------

    def create_stream(self, reuse=None):
        """A new simulated stream handle (an int, as a ``CUstream`` would be).

        ``reuse``: a destroyed stream's handle to give the new stream, as a driver may; the
        new stream still has a new stream ID (``cuStreamGetId``).
        """
        if reuse is not None:
            if reuse in self._queued:
                self._misuse(f"stream {reuse:#x} is not destroyed")
            handle = reuse
        else:
            handle = next(self._handles)
        self._queued[handle] = self._done[handle] = 0
        self._stream_ids[handle] = next(self._ids)
        return handle

    def destroy_stream(self, stream):
        """Forget a stream; later use of its handle is an error, as on a real device."""
        if stream in (LEGACY_STREAM, PER_THREAD_STREAM):
            self._misuse(f"the default stream {stream} cannot be destroyed")
        self._check_stream(stream)
        del self._queued[stream], self._done[stream]

    def per_thread_stream(self, thread=None):
        """The per-thread default stream of ``thread`` (a ``threading.get_ident()``; default:
        the calling thread's), as ``ordered``, ``pending``, ``complete`` and ``queued`` take
        it: handle 2 names it only on its own thread."""
        key = (PER_THREAD_STREAM, threading.get_ident() if thread is None else thread)
        self._queued.setdefault(key, 0)
        self._done.setdefault(key, 0)
        return key

    def launch(self, stream=LEGACY_STREAM):
        """Enqueue simulated work ("a kernel still running") on ``stream``."""
        self._queued[self._check_stream(stream)] += 1

    def complete(self, stream=None):
        """Finish the pending work of ``stream`` (``None``: every stream)."""
        streams = list(self._queued) if stream is None else [stream]
        for s in streams:
            key = self._check_stream(s)
            self._done[key] = self._queued[key]

    def pending(self, stream):
        """Whether ``stream`` has unfinished work."""
        key = self._check_stream(stream)
        return self._done[key] < self._queued[key]

    def queued(self, stream):
        """How many items of work were queued on ``stream`` so far (for ``ordered``)."""
        return self._queued[self._check_stream(stream)]

    def ordered(self, stream, before, work):
        """Whether new work on ``stream`` runs after the first ``work`` items of ``before``:
        they are done, ``stream`` waits for an event that covers them, or the two are the
        legacy stream and a per-thread stream (which synchronize with each other)."""
        stream, before = self._key(stream), self._key(before)
        if self._done.get(before, work) >= work or {_kind(stream), _kind(before)} == _BLOCKING:
            return True
        return any(s == before and n >= work
                   for event in self._waits.get(stream, ()) for s, n in self._events[event])

    def calls_named(self, name):
        """The arguments of every call named ``name``, in order."""
        return [args for call, args in self.calls if call == name]

    def _key(self, stream):
        """The stream a handle names on the calling thread (a per-thread stream's key, made
        on first use, for handle 2); keys from per_thread_stream pass through."""
        if stream == PER_THREAD_STREAM:
            return self.per_thread_stream()
        return stream

    def _check_stream(self, stream):
        """The stream's key; a misuse for an unknown or destroyed stream."""
        key = self._key(stream)
        if key not in self._queued:
            self._misuse(f"unknown or destroyed stream {stream:#x}")
        return key

    def _covered(self, key):
        """(stream, work number) of what an event recorded now on stream ``key`` waits for:
        its work so far, what it waits for, and, between the legacy stream and the per-thread
        streams (blocking streams), each other's work so far."""
        streams = [key] + [s for s in self._queued
                           if s != key and {_kind(key), _kind(s)} == _BLOCKING]
        return [(s, self._queued[s]) for s in streams] + [
            dep for e in self._waits.get(key, ()) for dep in self._events[e]]

    def _misuse(self, what):
        self.errors.append(what)
        raise ValueError(f"simulated device: {what}")

    # The upstream side (called by the pool) --------------------------------------------

    def _count(self, nbytes, rounded):
        self.used += nbytes
        self.device_bytes += rounded
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _alloc(self, nbytes, stream=None):
        self.calls.append(("alloc", (nbytes,) if stream is None else (nbytes, stream)))
        if stream is not None:
            stream = self._check_stream(stream)
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"simulated device out of memory: {nbytes} B requested")
        if self.shareable:
            ptr, array = self._shared_alloc(nbytes), None
        else:
            array = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
            ptr = -array.ctypes.data % ALIGNMENT + array.ctypes.data
        self._arrays[ptr] = (array, nbytes)
        self._count(nbytes, -(-nbytes // self.page) * self.page)
        if stream is not None:
            self._queued[stream] += 1       # the allocation is work in the stream's order
            self.allocated_on[ptr] = (stream, self._queued[stream])
        return ptr

    def _free(self, ptr):
        self.calls.append(("free", (ptr,)))
        if ptr not in self._arrays:
            self._misuse(f"free of unknown pointer {ptr:#x}")
        nbytes = self._arrays.pop(ptr)[1]
        self._count(-nbytes, -(-nbytes // self.page) * -self.page)
        self.allocated_on.pop(ptr, None)
        if ptr in self._shared:
            fd, length = self._shared.pop(ptr)
            if not _unlocked(fd):
                # Not raised: the pool frees without looking at the result (trim).
                self.errors.append(f"free of {nbytes} B at {ptr:#x} while another process holds "
                                   f"it open (cuMemFree of memory opened with "
                                   f"cuIpcOpenMemHandle elsewhere is undefined on a GPU)")
            _libc.munmap(ptr, length)
            os.close(fd)

    def _shared_alloc(self, nbytes):
        """Host memory another process can map: a memfd mapped shared (page aligned)."""
        length = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("gpupool-simulated", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, length)
            ptr = _mmap(None, length, mmap.MAP_SHARED, fd)
        except BaseException:
            os.close(fd)
            raise
        self._shared[ptr] = (fd, length)
        return ptr

    # Virtual memory (virtual_memory=True) ------------------------------------------------

    def _reserve(self):
        size = self.va_bytes
        self.calls.append(("reserve", (size,)))
        va = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if va in (None, ctypes.c_void_p(-1).value):
            raise MemoryError("simulated device: no host address space for a reservation")
        self._ranges[va] = (size, set())
        return va

    def _unreserve(self, va):
        self.calls.append(("unreserve", (va,)))
        if va not in self._ranges:
            self._misuse(f"unreserve of unknown range {va:#x}")
        size, mapped = self._ranges[va]
        if mapped:
            self._misuse(f"unreserve of range {va:#x} with {len(mapped)} pages still mapped")
        _libc.munmap(va, size)
        del self._ranges[va]

    def _pages(self, va, nbytes, what):
        """The reserved range holding [va, va + nbytes) and the page starts in it."""
        for start, (size, mapped) in self._ranges.items():
            if start <= va and va + nbytes <= start + size:
                if (va - start) % self.page or nbytes % self.page or nbytes == 0:
                    self._misuse(f"{what} of {nbytes} B at {va:#x}: not whole pages")
                return mapped, range(va, va + nbytes, self.page)
        self._misuse(f"{what} of {nbytes} B at {va:#x}: outside every reserved range")

    def _map(self, va, nbytes):
        self.calls.append(("map", (va, nbytes)))
        mapped, pages = self._pages(va, nbytes, "map")
        if any(p in mapped for p in pages):
            self._misuse(f"map of {nbytes} B at {va:#x}: a page is mapped already")
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"simulated device out of memory: {nbytes} B to map")
        if self.shareable:
            for p in pages:             # each page a memfd of its own, as cuMemCreate's
                fd = os.memfd_create("gpupool-simulated-page", os.MFD_CLOEXEC)
                os.ftruncate(fd, self.page)
                _mmap(p, self.page, mmap.MAP_SHARED | _MAP_FIXED, fd)
                self._page_fds[p] = fd
        mapped.update(pages)
        self._count(nbytes, nbytes)

    def _unmap(self, va, nbytes):
        self.calls.append(("unmap", (va, nbytes)))
        mapped, pages = self._pages(va, nbytes, "unmap")
        if not all(p in mapped for p in pages):
            self._misuse(f"unmap of {nbytes} B at {va:#x}: a page is not mapped")
        busy = [s for s in self._queued if self._done[s] < self._queued[s]]
        if busy:
            self._misuse(f"unmap of {nbytes} B at {va:#x} while streams {busy} have work "
                         f"pending that may use it")
        mapped.difference_update(pages)
        if self.shareable:              # the reservation's anonymous memory comes back
            _mmap(va, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED)
            for p in pages:
                os.close(self._page_fds.pop(p))
        else:
            _libc.madvise(va, nbytes, _MADV_DONTNEED)      # the host memory goes back too
        self._count(-nbytes, -nbytes)

    def mapped(self, va, nbytes=1):
        """Whether [va, va + nbytes) lies in mapped pages (virtual_memory=True)."""
        for start, (size, pages) in self._ranges.items():
            if start <= va < start + size:
                first = start + (va - start) // self.page * self.page   # pages from start
                return all(p in pages for p in range(first, va + nbytes, self.page))
        return False

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
        self.calls.append(("ipc_export", (base, size)))
        if not self.shareable:
            raise IpcError(self.ipc_refusal, "not_exportable")
        if self.expandable:
            pages = range(base, base + size, self.page)
            if any(p not in self._page_fds for p in pages):
                self._misuse(f"export of {size} B at {base:#x}: a page is not mapped")
            return [os.dup(self._page_fds[p]) for p in pages]
        if base not in self._shared or self._arrays[base][1] != size:
            self._misuse(f"export of {size} B at {base:#x}: not one allocation")
        fd = self._shared[base][0]
        return f"{os.getpid()}:{fd}:{os.fstat(fd).st_ino}".encode()

    def _ipc_open(self, kind, payload, size):
        self.calls.append(("ipc_open", (kind, size)))
        if kind == "posix_fd":
            page = size // len(payload)
            va = _mmap(None, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
            for i, fd in enumerate(payload):
                _mmap(va + i * page, page, mmap.MAP_SHARED | _MAP_FIXED, fd)
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
            va = _mmap(None, size, mmap.MAP_SHARED, mine)
        except BaseException:
            os.close(mine)
            raise
        self._opened[va] = (mine, size, bytes(payload))
        return va

    def _ipc_close(self, kind, address, size):
        self.calls.append(("ipc_close", (kind, size)))
        if address not in self._opened:
            self._misuse(f"close of {address:#x}, which no IPC open mapped")
        fd, length, _ = self._opened.pop(address)
        _libc.munmap(address, length)
        if fd is not None:
            os.close(fd)

    def _ipc_event_create(self):
        event = next(self._handles)
        self.calls.append(("ipc_event_create", (event,)))
        return event

    def _ipc_event_record(self, event, stream):
        self.calls.append(("ipc_event_record", (event, stream)))
        self._check_stream(stream)
        # Simulated work is done when a host copy returns: nothing to wait for elsewhere.
        return f"simulated-event-{os.getpid()}-{event}".encode()

    def _ipc_event_destroy(self, event):
        self.calls.append(("ipc_event_destroy", (event,)))

    def _ipc_wait(self, handle, stream):
        self.calls.append(("ipc_wait", (bytes(handle), stream)))
        self._check_stream(stream)

    def _device_uuid(self):
        return self._uuid

    def _event_create(self):
        event = next(self._handles)
        self.calls.append(("event_create", (event,)))
        self._events[event] = []
        return event

    def _event_destroy(self, event):
        self.calls.append(("event_destroy", (event,)))
        del self._events[event]

    def _event_record(self, event, stream):
        self.calls.append(("event_record", (event, stream)))
        # The event completes when the stream's work so far, and what it waits for, is done.
        self._events[event] = self._covered(self._check_stream(stream))

    def _event_query(self, event):
        self.calls.append(("event_query", (event,)))
        return all(self._done.get(s, n) >= n for s, n in self._events[event])

    def _stream_wait_event(self, stream, event):
        self.calls.append(("stream_wait_event", (stream, event)))
        key = self._check_stream(stream)
        # The wait is on the event as recorded now; a later record of it changes nothing.
        copy = next(self._handles)
        self._events[copy] = list(self._events[event])
        self._waits.setdefault(key, []).append(copy)

    def _synchronize(self):
        self.calls.append(("synchronize", ()))
        if self.capturing:
            self._misuse(f"synchronize while streams {sorted(self.capturing)} are being "
                         f"captured (the captures would be invalidated)")
        self.complete()

    def _stream_capturing(self, stream):
        self.calls.append(("stream_capturing", (stream,)))
        self._check_stream(stream)
        return stream in self.capturing

    def _check_mapped(self, ptr, nbytes, what):
        if self._ranges and any(start <= ptr < start + size
                                for start, (size, _) in self._ranges.items()) \
                and not self.mapped(ptr, nbytes):
            self._misuse(f"{what} of {nbytes} B at {ptr:#x}: memory not mapped")

    def _copy(self, kind, dst, src, nbytes, stream):
        self.calls.append(("copy", (kind, dst, src, nbytes, stream)))
        self._check_stream(stream)
        self._check_mapped(dst, nbytes, "copy")
        self._check_mapped(src, nbytes, "copy")
        ctypes.memmove(dst, src, nbytes)

    def _memset(self, dst, value, nbytes, stream):
        self.calls.append(("memset", (dst, value, nbytes, stream)))
        self._check_stream(stream)
        self._check_mapped(dst, nbytes, "memset")
        ctypes.memset(dst, value, nbytes)

    def _stream_id(self, stream):
        self._check_stream(stream)
        return self._stream_ids[stream]

    def _trim(self):
        self.calls.append(("trim", ()))

    def _mem_info(self):
        self.calls.append(("mem_info", ()))
        return self.capacity - self.used, self.capacity

    def __repr__(self):
        kind = ", virtual_memory=True" if self.expandable else ""
        return f"SimulatedDevice(capacity={self.capacity}{kind}, used={self.used})"


_BLOCKING = {"legacy", "per-thread"}       # a pair of streams that synchronize with each other


def _kind(key):
    """"legacy", "per-thread" or "created": how a stream key synchronizes with others."""
    if key == LEGACY_STREAM:
        return "legacy"
    return "per-thread" if isinstance(key, tuple) else "created"


def _mmap(address, length, flags, fd=-1):
    """libc mmap, readable and writable; raises OSError when it fails."""
    va = _libc.mmap(address, length, _PROT_RW, flags, fd, 0)
    if va in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"simulated device: mmap of {length} B: {os.strerror(err)}")
    return va


def _unlocked(fd):
    """Whether no other process holds a lock on fd's file (an importer's mapping)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _invalid_value(why):
    return CudaError(1, "CUDA_ERROR_INVALID_VALUE", f"simulated device: {why}")


def _no_total():
    raise ValueError("a simulated device's capacity is its total memory: give bytes or a size "
                     "such as '1GiB', not a percentage")
