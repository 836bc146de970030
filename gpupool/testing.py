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

``Failures`` injects driver failures: the n-th call of a kind fails, or calls fail at random
at a seeded rate. The memory source's calls fail as the driver's out of memory (the pool's
out-of-memory ladder runs, then ``OutOfMemoryError``), the others as a ``CudaError``::

    from gpupool.testing import Failures
    sim = SimulatedDevice(failures=Failures("alloc", nth=2))   # the second cuMemAlloc fails
    sim.inject(Failures(("event_record", "free"), rate=0.1, seed=1))
    sim.inject(None)                                            # no call fails any more
"""

import ctypes
import mmap

import numpy as np

from gpupool.limits import parse_limit
from gpupool.public import public_dir
from gpupool.simulated.failures import Failures
from gpupool.simulated.host import libc, map_rw
from gpupool.simulated.sharing import SimulatedSharing
from gpupool.simulated.streams import (
    LEGACY_STREAM,  # noqa: F401  (re-exported)
    PER_THREAD_STREAM,  # noqa: F401  (re-exported)
    SimulatedStreams,
)
from gpupool.simulated.virtual_memory import SimulatedVirtualMemory
from gpupool.upstream.python import PythonUpstream

__all__ = ["Failures", "SimulatedDevice"]


def __dir__():
    """The public API and the module's dunder attributes, not the names it imports."""
    return public_dir(globals(), __all__)


ALIGNMENT = 256
PAGE_BYTES = 2 << 20                    # the driver's page (cuMemAlloc rounds to it)


class SimulatedDevice(SimulatedStreams, SimulatedVirtualMemory, SimulatedSharing, PythonUpstream):
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
    failures : Failures, optional
        Simulated driver calls that fail (``gpupool.testing.Failures``: the n-th call of the
        named kinds, or each at a seeded rate); ``inject`` changes or clears it later. A
        failed call has no effect on the device: a failed ``free`` or ``unmap`` leaves the
        memory allocated, a failed ``alloc`` or ``map`` takes none. ``alloc``, ``reserve``
        and ``map`` (and its ``create`` step) fail as out of memory, by default (they raise
        ``MemoryError``, which the pool reads as CUDA_ERROR_OUT_OF_MEMORY); other calls
        raise ``gpupool.CudaError`` (CUDA_ERROR_UNKNOWN, 999, by default), which reaches the
        caller of the pool operation that made the call unless the pool handles it.

    Raises
    ------
    ValueError, TypeError
        A capacity or page that is not a positive size (``gpupool.limits.parse_limit``), a
        page that is not a multiple of 512 B (of the host's page with ``shareable`` and
        ``virtual_memory``), an impossible device (negative, not an int), ``shareable`` with
        ``stream_ordered``, a ``uuid`` that is not 16 bytes, or ``failures`` that is not a
        ``Failures``.

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
        ``stream_ordered``, ``alloc``'s arguments are ``(nbytes, stream)``. A call that an
        injected failure fails is logged all the same.
    failures : Failures or None
        The failures injected now (``inject`` sets it); its ``injected`` lists the calls
        that failed.
    used : int
        Bytes currently allocated (or mapped).
    total_bytes : int
        ``capacity``: the total a pool reads at creation, without a ``mem_info`` call, so
        that its out-of-memory error says when a request can never fit.
    device_bytes, peak_device_bytes : int
        The device memory that would be in use, now and at the most: allocations rounded
        up to ``page`` (mapped pages with ``virtual_memory``); what ``cuMemGetInfo`` would
        count.
    capturing : set of int
        Handles of the streams a test says are being captured into a CUDA graph (empty at
        first): ``stream_capturing`` reports them; a ``synchronize`` meanwhile is a misuse
        (it would invalidate the capture), and so are a ``stream_wait_event`` across a
        capture's boundary (one of the stream and the event's last record in a capture, the
        other not: capture isolation) and an ``event_query`` while any stream is being
        captured (the driver refuses it in a capture of the global mode).
    errors : list of str
        Every misuse seen, whether or not an exception reached the caller: a call on an
        unknown or destroyed stream, a free of an unknown pointer, a free of memory another
        process holds open. A refused call raises as the driver path does where the driver
        refuses it with a status (a stream handle it does not know: ``gpupool.CudaError``
        CUDA_ERROR_INVALID_HANDLE), else ValueError, and stays listed when the caller catches
        it; a pool freeing from ``__dealloc__`` cannot report it, and the free of memory held
        open elsewhere raises nothing. Tests should check that this list is empty; one that
        misuses the device on purpose (a bad stream handle) checks its entries and clears it.
    """

    def __init__(self, capacity=1 << 30, device=0, stream_ordered=False, virtual_memory=False,
                 page=PAGE_BYTES, shareable=False, uuid=None, failures=None):
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
        self._init_sharing(shareable, uuid)
        self._set_stream_ordered(stream_ordered)
        self._set_host_accessible(True)     # buffers export DLPack as kDLCPU: NumPy reads them
        self.capacity = capacity
        self.page = page
        if virtual_memory:
            self._set_expandable(self.page, -(-self.capacity // self.page) * self.page)
        self._init_virtual_memory()
        self._init_base(failures)
        self._arrays = {}               # pointer -> (numpy array holding it, nbytes)
        self._pinned = {}               # host_alloc's: pointer -> bytes
        self._init_streams()
        self.allocated_on = {}          # stream-ordered: pointer -> (stream, work number)

    # The upstream's memory source (called by the pool) ---------------------------------

    def _alloc(self, nbytes, stream=None):
        self._called("alloc", (nbytes,) if stream is None else (nbytes, stream))
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
            # The allocation is work in the stream's order.
            self.allocated_on[ptr] = (stream, self._enqueue(stream))
        return ptr

    def _free(self, ptr):
        self._called("free", (ptr,))
        if ptr not in self._arrays:
            self._misuse(f"free of unknown pointer {ptr:#x}")
        nbytes = self._arrays.pop(ptr)[1]
        self._count(-nbytes, -(-nbytes // self.page) * -self.page)
        self.allocated_on.pop(ptr, None)
        self._shared_free(ptr, nbytes)

    def _allocation_bytes(self, ptr):
        """Bytes of the allocation at ``ptr``."""
        return self._arrays[ptr][1]

    def _trim(self):
        self._called("trim", ())

    def _mem_info(self):
        self._called("mem_info", ())
        return self.capacity - self.used, self.capacity

    @property
    def total_bytes(self):
        return self.capacity

    # Copies ----------------------------------------------------------------------------

    def _copy(self, kind, dst, src, nbytes, stream):
        self._called("copy", (kind, dst, src, nbytes, stream))
        self._check_stream(stream)
        self._check_mapped(dst, nbytes, "copy")
        self._check_mapped(src, nbytes, "copy")
        ctypes.memmove(dst, src, nbytes)

    def _memset(self, dst, value, nbytes, stream):
        self._called("memset", (dst, value, nbytes, stream))
        self._check_stream(stream)
        self._check_mapped(dst, nbytes, "memset")
        ctypes.memset(dst, value, nbytes)

    def _host_alloc(self, nbytes):
        """Host memory standing in for page-locked memory (Pool.sleep's offload)."""
        self._called("host_alloc", (nbytes,))
        ptr = map_rw(None, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._pinned[ptr] = nbytes
        return ptr

    def _host_free(self, ptr):
        self._called("host_free", (ptr,))
        if ptr not in self._pinned:
            self._misuse(f"host_free of {ptr:#x}: not from host_alloc")
        libc.munmap(ptr, self._pinned.pop(ptr))

    @property
    def pinned_bytes(self):
        """Bytes of host memory from ``_host_alloc`` not given back."""
        return sum(self._pinned.values())

    def __repr__(self):
        kind = ", virtual_memory=True" if self.expandable else ""
        return f"SimulatedDevice(capacity={self.capacity}{kind}, used={self.used})"


def _no_total():
    raise ValueError("a simulated device's capacity is its total memory: give bytes or a size "
                     "such as '1GiB', not a percentage")
