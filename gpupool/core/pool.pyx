# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The pool: one device's caching allocator (docs/design.md has the contract).

A request is rounded to 512 bytes and served by best fit from the pool's free lists
(``core/freelist.pxd``), in stream order (``core/streamorder.pxd``): blocks cached by the region in
front of it (``core/regioncache.pxd``) and the pool's own, then, before the pool grows, those of
idle regions. A larger block is cut and the rest stays free; a freed block joins its free
neighbours (``core/segments.pxd``). Else the pool grows: a new segment of a plain upstream, or
more pages of the stream's expandable segment (``core/segments.pxd``). When the upstream is out of
memory, the ladder: give this pool's cached memory back, retry; untag every region's cache
and give it back, retry; then the caller runs the ``on_oom`` callbacks and retries once more
before raising ``OutOfMemoryError``.

Everything runs under the pool's lock, taken without blocking other Python threads (the GIL
is released while waiting). A free made by the thread that holds the lock (a garbage
collection run by a Python upstream, say) is deferred until that thread unlocks.
"""
from libc.stdint cimport uintptr_t
from libcpp.algorithm cimport sort
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.records.block cimport Block, Segment, LIVE, FREE, PARKED, UNMAPPED, HELD
from gpupool.buffer.device_buffer cimport DeviceBuffer, new_buffer
from gpupool.buffer.owner cimport BlockOwner
from gpupool.records.counters cimport count_acquired, count_released
from gpupool.driver.calls cimport fork_flag
from gpupool.core.freelist cimport fl_each, fl_has_exact
from gpupool.core.magazine cimport (
    Magazine, MAG_SLOTS, MAG_HANDED, mg_find, mg_largest, mg_remove, mg_find_handed, mg_unhand,
)
from gpupool.buffer.handoff cimport use_key
from gpupool.history.ring cimport (
    LogKind, LOG_LADDER_NOTHING, LOG_LADDER_TRIM, LOG_LADDER_REGIONS, LOG_CALLBACK_RETRY,
    LOG_SOFT_TRIM, LOG_STREAM_TRIM, hist_on, hist_subscribe, register_pool, hist_alloc,
    hist_free, hist_oom, hist_log, hist_flush_log,
)
from gpupool.core.regioncache cimport (
    RegionCache, rc_link, rc_detach, rc_own, rc_disown, rc_freed_into, rc_drain,
    rc_return_unused,
)
from gpupool.core.segments cimport (
    round_request, sg_put, sg_split, sg_split_top, sg_grow_plain, sg_extend, sg_trim,
    sg_reclaim,
    sg_merge_streams, sg_release_all,
)
from gpupool.records.sizes cimport MAX_NBYTES, SMALL_REQUEST, check_nbytes
from gpupool.driver.status cimport GP_REENTRANT, GP_FORKED
from gpupool.core.streamorder cimport (
    WANTED_MAX, so_event, so_take, so_take_small, so_under_small, so_mark_blocks,
    so_mark_stream, so_is_wanted,
)
from gpupool.records.streams cimport (
    StreamKey, BAD_STREAM_TAG, OWN_HANDLE_TAG, STREAM_PER_THREAD, current_thread,
    resolved_free_key, same_stream, stream_key,
    created_stream_key, refused_stream_status, stream_handle,
)
from gpupool.upstream.upstreams cimport Upstream, DriverUpstream, AsyncUpstream, VmmUpstream

import logging
import os

from gpupool.errors import (
    FORK_MESSAGE, CudaError, GpupoolError, OutOfMemoryError, not_picklable,
)
from gpupool.stats import PoolStats, format_bytes, torch_memory_stats

cdef extern from "Python.h" nogil:
    ctypedef struct PyThreadState
    int PyGILState_Check()
    PyThreadState* PyEval_SaveThread()
    void PyEval_RestoreThread(PyThreadState*)

_UPSTREAMS = {"driver": DriverUpstream, "async": AsyncUpstream, "vmm": VmmUpstream}


def _default_upstream(int device):
    """Expandable segments, where the device has virtual memory management (on the recorded
    ResNet-50 and GPT-2 runs they reserve the least: docs/design.md); else the driver's."""
    try:
        return VmmUpstream(device)
    except CudaError:
        return DriverUpstream(device)


_oom_callbacks = []
cdef const int* FORKED = fork_flag()
# This module's copy of the memory history's switch (history/ring.pxd): nonzero while it records
# (magazines are passed by then, so that every allocation and free is recorded).
cdef int RECORDING = 0
hist_subscribe(&RECORDING)
_logger = logging.getLogger("gpupool")
# Blocks up to this size are parked, and held in threads' magazines (core/magazine.pxd). Parked
# and held blocks go to the free lists when a request finds no free block of its exact size
# (so a cut sees the whole free memory). On the recorded traces (bench/fragmentation.py,
# simulated device) 8 slots up to 64 MiB reserve no more than 4 slots up to 4 MiB did, and
# less on ResNet-50 (5,712 against 5,756 MiB); 4 slots up to 64 MiB raised GPT-2's region
# replay to 8,870 MiB.
cdef size_t PARK_MAX = 64 << 20
cdef size_t MAG_MAX = 64 << 20
cdef size_t MAG_AGE = 2
# Pauses (x86 `pause`: 10 to 140 cycles by model) a thread waits at most for its own
# magazine's lock while a sweep of the pool holds it, before taking the shared path (_mag_wait).
cdef unsigned MAG_SPINS = 1024
# A small request (at most MAG_SMALL bytes: PyTorch's small-pool bound) leaves the calling
# thread's held blocks of MAG_KEEP times its size or more where they are (_mag_keeps).
cdef size_t MAG_SMALL = 1 << 20
cdef size_t MAG_KEEP = 8
# GPUPOOL_MAGAZINES=0 (read at import): no thread keeps freed blocks in a magazine; every free
# and request takes the shared path. For memory measurements across threads (PyTorch's
# autograd thread allocates while the main thread's magazine holds what it freed).
cdef bint MAGAZINES = os.environ.get("GPUPOOL_MAGAZINES", "").strip() != "0"


cdef inline int wanted_bit(StreamKey s) noexcept nogil:
    """The stream's bit in the pool's wanted mask (Fibonacci hashing of its key)."""
    return <int>(((s.handle ^ (s.tag << 1)) * 0x9E3779B97F4A7C15ULL) >> 58)


cdef inline bint _mag_keeps(Block* b, size_t size) noexcept nogil:
    """Whether a request of size bytes leaves held block b in its thread's magazine: a small
    request does not break a block of MAG_KEEP times its size or more; the pool grows for it
    instead (on an expandable upstream a page at most; on a plain one a new segment, up to
    20 MiB when shared), or, out of memory, every magazine is flushed first. Without
    this, a thread cycling through 256 B .. 16 MiB on an expandable segment (one range per
    stream) cut the small blocks from its 16 MiB one and joined them back for the next
    16 MiB request: every request took the pool's lock (issue 18)."""
    return size <= MAG_SMALL and b.size >= MAG_KEEP * size

include "regionstack.pxi"


def size_class(nbytes):
    """Bytes a request of ``nbytes`` takes from the pool: ``nbytes`` rounded up to a multiple
    of 512 (at most 511 B more); 0 for 0.

    Parameters
    ----------
    nbytes : int
        Request in bytes, 0 <= nbytes <= 2**50.
    """
    return round_request(check_nbytes(nbytes))


cdef class Pool(BlockOwner):
    """A caching pool of device memory on one device.

    ``Pool(device=0, upstream=None, hard_limit=None, soft_limit=None)``

    Parameters
    ----------
    device : int
        Device ordinal, >= 0 (ignored when ``upstream`` is an ``Upstream`` object, whose
        device is used; checked all the same).
    upstream : {"driver", "async", "vmm"}, gpupool.Upstream or None
        Where memory comes from: ``"driver"`` (``cuMemAlloc`` / ``cuMemFree`` on the
        device's primary context), ``"async"`` (a driver memory pool of the pool's own,
        ``cuMemAllocFromPoolAsync`` on the requesting stream / ``cuMemFreeAsync``, whose
        release threshold is the soft limit: see ``gpupool.AsyncUpstream``), ``"vmm"``
        (expandable segments: per stream, a reserved range of address space whose pages are
        mapped as it grows: see ``gpupool.VmmUpstream``) or an ``Upstream`` object such as
        ``gpupool.testing.SimulatedDevice``. Default: ``GPUPOOL_UPSTREAM`` from the
        environment, else ``"vmm"`` (``"driver"`` on a device without virtual memory
        management).
    hard_limit, soft_limit : int or str, optional
        Bytes the pool may reserve (hard: never exceeded; soft: cached blocks are released
        when exceeded), as an int or a string such as ``"512MiB"``, ``"8GB"``, ``"50%"``.
        Default: ``GPUPOOL_HARD_LIMIT`` / ``GPUPOOL_SOFT_LIMIT`` from the environment.

    Raises
    ------
    NoDeviceError
        No driver or no such device (driver upstreams).
    ValueError, TypeError
        An impossible ``device`` (negative, not an int: before any driver call), a malformed
        limit (the message names the argument or variable), a soft limit above the hard
        one, or a malformed upstream (``GPUPOOL_UPSTREAM`` included).
    """

    def __cinit__(self, device=0, upstream=None, hard_limit=None, soft_limit=None):
        from gpupool.driver.ordinals import check_ordinal
        from gpupool.limits import resolve_limits
        self._segments.recording = &RECORDING
        device = check_ordinal(device)
        if upstream is None:
            upstream = os.environ.get("GPUPOOL_UPSTREAM") or None   # empty: unset
            if upstream is None:
                upstream = _default_upstream(device)
            elif upstream not in _UPSTREAMS:
                raise ValueError(f"GPUPOOL_UPSTREAM={upstream!r}: must be one of "
                                 f"{', '.join(_UPSTREAMS)}")
        if isinstance(upstream, Upstream):
            self.upstream = upstream
        elif isinstance(upstream, str) and upstream in _UPSTREAMS:
            self.upstream = _UPSTREAMS[upstream](device)
        elif isinstance(upstream, str):
            raise ValueError(f"upstream must be 'driver', 'async', 'vmm' or an Upstream "
                             f"object, got {upstream!r}")
        else:
            raise TypeError(f"upstream must be 'driver', 'async', 'vmm' or an Upstream "
                            f"object, got {type(upstream).__name__}")
        self.device = self._segments.device = self.upstream.device
        self._segments.hard_limit, self._soft_limit = resolve_limits(
            hard_limit, soft_limit, lambda: self.mem_info()[1])
        # A stream-ordered upstream keeps freed memory up to the soft limit for regrowth.
        self.upstream.raise_error(self.upstream.set_release_threshold(self._soft_limit),
                                  "set_release_threshold")
        self._segments.pool_id = register_pool(self)

    def __dealloc__(self):
        # Buffers and regions hold references to their pool, so only free lists remain.
        cdef size_t i
        if FORKED[0]:
            return
        # Threads' magazines let go of the pool whatever else happens (the garbage collector
        # may have cleared upstream already): a thread must never take a dead pool's
        # magazine for a new pool at the same address.
        for i in range(self._magazines.size()):
            detach_magazine(self._magazines[i])
        self._magazines.clear()
        if self.upstream is None:
            return
        self._mutex.lock()
        if self._segments.head != NULL and (self.upstream.expandable
                                            or self.upstream.stream_ordered):
            # Queued work may still use freed blocks: unmapping pages (cuMemUnmap) does not
            # wait for it as cuMemFree does, nor does a stream-ordered free wait for other
            # streams' work. (A failure: the context is gone, and its work with it.)
            if self.upstream.synchronize() != 0:
                self.upstream.clear_error()
        sg_release_all(&self._segments, self.upstream, &self._order)
        for i in range(self._order.events.size()):
            self.upstream.event_destroy(self._order.events[i])
        self._mutex.unlock()

    # Locking --------------------------------------------------------------------------

    cdef void lock(self) noexcept nogil:
        if not self._mutex.try_lock():
            self._wait()
        self._holder = current_thread()

    cdef void _wait(self) noexcept nogil:
        # A Python thread waiting for the lock lets the others run: the holder may need the
        # GIL (a Python upstream), and must not deadlock against us.
        cdef PyThreadState* state
        if PyGILState_Check():
            state = PyEval_SaveThread()
            self._mutex.lock()
            PyEval_RestoreThread(state)
        else:
            self._mutex.lock()

    cdef void unlock(self) noexcept nogil:
        cdef Block* b
        while not self._deferred.empty():
            b = self._deferred.back()
            self._deferred.pop_back()
            self.release_locked(b, b.stream)
        if self._nwanted or not self._order.wanted.empty():
            self._copy_wanted()
        self._holder = 0
        self._mutex.unlock()

    cdef void _copy_wanted(self) noexcept nogil:
        """Under the pool's lock: publish the wanted streams to the fast path (mag_take). A
        racy read may see a half-written key: then a wanted stream's request goes the fast
        way once (its answer waits for the next), or another stream's the shared way."""
        cdef size_t i, n = self._order.wanted.size()
        cdef unsigned long long mask = 0
        for i in range(n):
            mask |= 1ULL << wanted_bit(self._order.wanted[i])
            if i < WANTED_FAST:
                self._wanted[i] = self._order.wanted[i]
        self._wanted_mask = mask
        self._nwanted = <int>n if n <= WANTED_FAST else WANTED_FAST + 1

    # Allocation -----------------------------------------------------------------------

    cdef StreamKey checked_key(self, uintptr_t handle) except *:
        """The stream's key, raising the driver's error for a handle it refuses (not a
        stream, or a destroyed one): for allocations and stream changes, where a bad handle
        is the caller's mistake."""
        cdef StreamKey key
        if handle <= STREAM_PER_THREAD:
            return stream_key(handle)               # no driver call, no upstream
        key = created_stream_key(self.upstream, handle)
        if key.tag == BAD_STREAM_TAG:
            self.upstream.raise_error(refused_stream_status(self.upstream, handle),
                                      f"cuStreamGetId (stream handle {handle:#x})")
        return key

    cdef int acquire(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil:
        """Take a block for nbytes > 0 used on stream s. Returns 0 or a status code."""
        cdef int r
        cdef Block* b
        if FORKED[0]:
            return GP_FORKED
        b = self.mag_take(nbytes, s, False)
        if b != NULL:
            out[0] = b
            return 0
        if self._holder == current_thread():
            return GP_REENTRANT
        self.lock()
        r = self.acquire_locked(nbytes, s, out)
        if hist_on(RECORDING) and r == 0:
            hist_alloc(self.device, self._segments.pool_id, out[0].ptr, nbytes, s.handle)
        self.unlock()
        return r

    cdef int acquire_locked(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil:
        cdef size_t size = round_request(nbytes)
        cdef RegionCache* rc
        cdef RegionCache* owner
        cdef Block* b
        cdef bint grew = False, answered = False, top = False
        cdef int r
        if self._segments.hard_limit and size > self._segments.hard_limit:
            size = nbytes               # only the exact request fits under the limit
        if not self._order.wanted.empty():
            if self._order.wanted.size() > WANTED_MAX:
                # Many streams hold blocks that others want and never allocate again (most
                # likely destroyed): one synchronize frees their blocks for every stream.
                self.trim_logged(LOG_STREAM_TRIM, WANTED_MAX)
            elif so_is_wanted(&self._order, s):
                # s is allocating, so it is alive: another stream waits for its free blocks,
                # whose events are recorded now (and those of blocks its thread lets go below).
                answered = True
                self._mag_give_up(s)
                so_mark_blocks(&self._order, self.upstream, &self._free, s)
        rc = current_cache(<void*>self, self._process_region)
        b = self._unpark(size, s, rc) if self._nparked else NULL
        if b == NULL and rc == NULL:
            b = self._mag_take_locked(size, s)
        if b != NULL:
            b.state = LIVE
            self.counters.cache_hits += 1
            if rc != NULL:
                rc_link(rc, b)
                rc.hits += 1
            self.count_taken(b.size)
            out[0] = b
            return 0
        if self._nparked and not fl_has_exact(&self._free, size, s):
            self.flush_parked()
        if not fl_has_exact(&self._free, size, s) and \
                (self._mag_flush_own(size, False) + self._mag_flush_others(s)) and answered:
            so_mark_blocks(&self._order, self.upstream, &self._free, s)
        if size <= SMALL_REQUEST and self.upstream.expandable:
            b = so_take_small(&self._free, size, s, <void*>rc)
            top = b != NULL and so_under_small(b)
        if b == NULL:
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, False)
        if b == NULL:
            # Idle regions' cached blocks serve before the pool grows: a region never costs
            # memory that the pool alone would not.
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
        if b == NULL and self._mag_reap() + self._mag_flush_own(size, True):
            # The calling thread's held blocks (but those a small request leaves), and exited
            # threads', serve before the pool grows.
            if answered:
                so_mark_blocks(&self._order, self.upstream, &self._free, s)
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
        if b == NULL:
            self._mag_want(size, s)
            r = self._grow_once(size, s, <void*>rc)
            if r == CUDA_ERROR_OUT_OF_MEMORY and self.mag_flush_all():
                # Out of memory: the blocks threads hold in their magazines serve first
                # (before then they stay with their threads, which use them).
                b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
        if b == NULL:
            if r == CUDA_ERROR_OUT_OF_MEMORY:
                r = self._ladder(size, s, <void*>rc)
            if r != 0:
                return r
            grew = True
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
            if b == NULL:
                return CUDA_ERROR_OUT_OF_MEMORY
        owner = rc_disown(b)
        if top:
            b = sg_split_top(&self._segments, &self._order, &self._free, b, size, s, owner)
        else:
            sg_split(&self._segments, &self._order, &self._free, b, size, s, owner)
        b.state = LIVE
        b.stream = s
        if grew:
            self.counters.cache_misses += 1
        else:
            self.counters.cache_hits += 1
        if rc != NULL:
            rc_link(rc, b)
            if grew:
                rc.misses += 1
            else:
                rc.hits += 1
        self.count_taken(b.size)
        if grew and self._soft_limit and self.counters.reserved > self._soft_limit:
            self.trim_logged(LOG_SOFT_TRIM, self._soft_limit)   # only growth crosses it
        out[0] = b
        return 0

    # A free of a block whose size is requested again at once (a scratch buffer, a step's
    # temporaries of one shape) would be cut from a joined block and joined back every time:
    # the last PARK_SLOTS freed blocks of up to PARK_MAX bytes are held aside, unjoined, for a
    # request of their exact size on their stream. Any other request, and everything that
    # walks the free lists (trims, stream merges, region exits, the ladder), puts them back
    # first (joined), so best fit always sees the whole free memory. Addresses are those the
    # free lists would give: a block of the exact size, the lowest address first.

    cdef Block* _unpark(self, size_t size, StreamKey s, RegionCache* rc) noexcept nogil:
        """The parked block of exactly size bytes, last used on s, that the request may take
        (the pool's or rc's, no record_stream events), at the lowest address as best fit
        would choose; NULL if none."""
        cdef int i, j, found = -1
        cdef Block* b
        for i in range(self._nparked):
            b = self._parked[i]
            if b.size == size and same_stream(b.stream, s) and b.extra_events == NULL and \
                    (b.region.cache == NULL or b.region.cache == <void*>rc) and \
                    (found < 0 or b.ptr < self._parked[found].ptr):
                found = i
        if found < 0:
            return NULL
        b = self._parked[found]
        for j in range(found, self._nparked - 1):
            self._parked[j] = self._parked[j + 1]
        self._nparked -= 1
        rc_disown(b)
        return b

    cdef void _park(self, Block* b) noexcept nogil:
        """Hold freed block b aside (the oldest parked one goes to the free lists if full)."""
        cdef int j
        if b.size > PARK_MAX:
            self._put(b)
            return
        if self._nparked == PARK_SLOTS:
            self._put(self._parked[0])
            for j in range(PARK_SLOTS - 1):
                self._parked[j] = self._parked[j + 1]
            self._nparked -= 1
        b.state = PARKED
        self._parked[self._nparked] = b
        self._nparked += 1

    cdef void _put(self, Block* b) noexcept nogil:
        """A free (or parked) block goes into the free lists, joined with its neighbours."""
        b.state = FREE
        sg_put(&self._segments, &self._order, &self._free, b)

    cdef void flush_parked(self) noexcept nogil:
        """Put every parked block into the free lists."""
        cdef int i
        for i in range(self._nparked):
            self._put(self._parked[i])
        self._nparked = 0

    cdef int _ladder(self, size_t size, StreamKey s, void* owner) noexcept nogil:
        """The upstream is out of memory for a request of size bytes on s (made through cache
        owner): give back this pool's cache and grow again, then every region's."""
        cdef int r = CUDA_ERROR_OUT_OF_MEMORY
        cdef size_t i, released
        if not self.counters.cached:
            hist_log(LOG_LADDER_NOTHING, self.device, size, 0, r)
        if self.counters.cached:
            self.counters.oom_retries += 1
            released = self.trim_locked()
            r = self._grow_once(size, s, owner)
            hist_log(LOG_LADDER_TRIM, self.device, size, released, r)
        if r == CUDA_ERROR_OUT_OF_MEMORY and self.counters.cached:
            self.counters.oom_retries += 1
            for i in range(self._regions.size()):
                rc_drain(self._regions[i])
            released = self.trim_locked()
            r = self._grow_once(size, s, owner)
            hist_log(LOG_LADDER_REGIONS, self.device, size, released, r)
        return r

    cdef int _grow_once(self, size_t size, StreamKey s, void* owner) noexcept nogil:
        """Grow the upstream for a request of size bytes on s (through cache owner: NULL,
        the pool). On an expandable one, the pool's cold free pages move to the growth first
        (sg_reclaim)."""
        if self.upstream.expandable:
            sg_reclaim(&self._segments, self.upstream, &self.counters, &self._order,
                       &self._free, size, s, owner)
            return sg_extend(&self._segments, self.upstream, &self.counters, &self._order,
                             &self._free, size, s, owner)
        return sg_grow_plain(&self._segments, self.upstream, &self.counters, &self._order,
                             &self._free, size, s)

    # Magazines (core/magazine.pxd) ---------------------------------------------------------

    cdef Magazine* thread_magazine(self, bint make) noexcept nogil:
        """The calling thread's magazine for this pool; made if make and there is none (and
        the thread's table has room); NULL otherwise. A magazine whose pool is gone (another
        pool now at this address) is deleted here, by its thread."""
        cdef gp_thread_magazine* slots = gp_this_thread().magazines
        cdef int i, empty = -1
        cdef Magazine* m
        for i in range(GP_THREAD_POOLS):
            if slots[i].pool == <void*>self:
                m = <Magazine*>slots[i].magazine
                if m.pool == <void*>self:       # no lock: only this pool's dealloc clears it
                    return m
                reclaim_magazine(&slots[i])     # the pool it was made for is gone
                empty = i
            elif slots[i].pool == NULL and empty < 0:
                empty = i
        if not make or FORKED[0] or not gp_thread_alive():
            return NULL
        if empty < 0:
            # Every slot taken: those of pools that are gone are free again.
            for i in range(GP_THREAD_POOLS):
                if (<Magazine*>slots[i].magazine).pool == NULL:
                    reclaim_magazine(&slots[i])
                    empty = i
            if empty < 0:
                return NULL
        m = new Magazine()
        m.pool = <void*>self
        m.orphan = False
        m.nblocks = m.nhanded = 0
        m.misses = m.requests = m.seen = m.settled = 0
        m.held = m.credit = m.allocs = m.frees = m.allocated_bytes = m.freed_bytes = 0
        m.wanted = m.no_block = m.no_credit = m.no_hand = m.empty = m.waits = m.free_waits = 0
        if self._holder == current_thread():
            self._deferred_magazine(m)
        else:
            self.lock()
            self._magazines.push_back(m)
            self.unlock()
        slots[empty].pool = <void*>self
        slots[empty].magazine = <void*>m
        gp_arm_reaper()
        return m

    cdef void _deferred_magazine(self, Magazine* m) noexcept nogil:
        # The thread holds the pool's lock already (a free inside an upstream call).
        self._magazines.push_back(m)

    cdef Block* mag_take(self, size_t nbytes, StreamKey s, bint capi) noexcept nogil:
        """A block for nbytes on s from the calling thread's magazine, without the pool's
        lock: a held block of the exact size last used on s, within the thread's credit,
        when the thread is in no region of this pool and its stream is not wanted. NULL:
        take the shared path. capi: list it as handed (the C API frees by pointer)."""
        cdef gp_thread* t
        cdef size_t size
        cdef Magazine* m
        cdef Block* b = NULL
        cdef int i
        if nbytes > MAG_MAX or RECORDING:
            return NULL
        t = gp_this_thread()
        if t.magazines[0].pool == <void*>self:
            m = <Magazine*>t.magazines[0].magazine
        else:
            m = self.thread_magazine(False)
        if m == NULL or m.pool != <void*>self:
            return NULL
        m.requests += 1                         # its thread is active (_mag_flush_others)
        if m.nblocks == 0:
            m.empty += 1
            return NULL
        if (self._wanted_mask >> wanted_bit(s)) & 1 and self._is_wanted_fast(s):
            m.wanted += 1
            return NULL                         # its blocks are wanted: the shared path
        if thread_cache(t, <void*>self, self._process_region) != NULL:
            return NULL
        size = round_request(nbytes)
        if not m.mutex.try_lock() and not self._mag_wait(m, &m.waits):
            return NULL
        i = mg_find(m, size, s)
        if i < 0:
            m.no_block += 1
        elif m.credit < size:
            m.no_credit += 1
        elif capi and m.nhanded >= MAG_HANDED:
            m.no_hand += 1
        else:
            b = mg_remove(m, i)
            m.credit -= size
            m.allocs += 1
            m.allocated_bytes += size
            b.state = LIVE
            if capi:
                m.handed[m.nhanded] = b
                m.nhanded += 1
        m.mutex.unlock()
        return b

    cdef bint _mag_wait(self, Magazine* m, size_t* waits) noexcept nogil:
        """The calling thread's magazine m, whose lock another thread holds: the pool's lock
        holder, sweeping every magazine (each for a few loads and stores). Waits for it a
        while (MAG_SPINS pauses) and counts the wait, since the shared path would wait for
        that holder's pool lock and then sweep every magazine itself, so that other threads
        found theirs taken in turn. Whether it got the lock: not when the calling thread holds
        the pool's lock (a free inside an upstream call), nor when the wait ran out (the
        sweeper may be waiting for something this thread holds, the GIL say): the shared
        path."""
        if self._holder == current_thread():
            return False
        waits[0] += 1
        return m.mutex.try_lock_spin(MAG_SPINS)

    cdef bint _is_wanted_fast(self, StreamKey s) noexcept nogil:
        """Without the lock, for a stream whose bit is in the wanted mask: whether it is in
        the list (more than WANTED_FAST wanted: the bit alone says yes)."""
        cdef int i
        if self._nwanted > WANTED_FAST:
            return True
        for i in range(self._nwanted):
            if same_stream(self._wanted[i], s):
                return True
        return False

    cdef Block* _mag_take_locked(self, size_t size, StreamKey s) noexcept nogil:
        """Under the pool's lock: the calling thread's held block of exactly size bytes on
        s, beyond its credit (counted as a shared acquire). NULL if none."""
        cdef Magazine* m = self.thread_magazine(False)
        cdef Block* b = NULL
        cdef size_t spent
        cdef int i
        if m == NULL or m.nblocks == 0:
            return NULL
        m.mutex.lock()
        i = mg_find(m, size, s)
        if i >= 0:
            b = mg_remove(m, i)
            # Bytes in use were counted (the pool counts held blocks as in use); its credit,
            # if any, is spent, the rest joins the bound as a shared acquire would.
            spent = size if m.credit >= size else m.credit
            m.credit -= spent
            self.counters.in_use -= size
            self.counters.cached += size
            self._bound -= spent
        m.mutex.unlock()
        return b

    cdef bint _mag_flush_own(self, size_t size, bint growing) noexcept nogil:
        """Under the pool's lock, for a request of size bytes of the calling thread: its held
        blocks go to the free lists, joined, but those a small request leaves (_mag_keeps).
        growing: the pool grows for it next, and all the others go. Else the request found
        neither a held nor a free block of its exact size (the caller checks), and only those
        it could be cut from and those that MAG_AGE such requests have passed by go, so that
        a cut sees the free memory (blocks held while others are cut raised the recorded
        traces' peaks), while a thread cycling through a few sizes keeps them. Whether any
        went."""
        cdef Magazine* m = self.thread_magazine(False)
        cdef bint dropped = False
        cdef int i
        if m == NULL or m.nblocks == 0:
            return False
        m.mutex.lock()
        if not growing:
            m.misses += 1
        i = m.nblocks
        while i:
            i -= 1
            if _mag_keeps(m.blocks[i], size):
                continue
            if growing or m.blocks[i].size >= size or m.misses - m.since[i] > MAG_AGE:
                self._mag_drop(m, i)
                dropped = True
        m.mutex.unlock()
        return dropped

    cdef bint mag_flush_mine(self) noexcept nogil:
        """Under the pool's lock: the calling thread's held blocks to the free lists; whether
        there were any."""
        cdef Magazine* m = self.thread_magazine(False)
        if m == NULL or m.nblocks == 0:
            return False
        m.mutex.lock()
        self._mag_flush(m)
        m.mutex.unlock()
        return True

    cdef bint _mag_flush_others(self, StreamKey s) noexcept nogil:
        """Under the pool's lock, for a request on s that found no free block of its exact
        size: the blocks held on s by threads that made no request since the last such look
        go to the free lists, joined, so that the cut sees that free memory too (PyTorch's
        autograd thread allocates the backward while the main thread, waiting, holds what the
        forward freed, and the other way round); whether any went. Threads that allocate keep
        theirs: taking them would have threads on one stream empty each other's magazines at
        every miss."""
        cdef Magazine* mine = self.thread_magazine(False)
        cdef Magazine* m
        cdef bint dropped = False
        cdef size_t k
        self._sweeps[SWEEP_OTHERS] += 1
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            if m == mine or m.nblocks == 0:
                continue
            m.mutex.lock()
            if m.requests == m.seen:            # idle since the last look
                dropped = self._mag_drop_stream(m, s) or dropped
            m.seen = m.requests
            m.mutex.unlock()
        return dropped

    cdef bint _mag_reap(self) noexcept nogil:
        """Under the pool's lock: the magazines of threads that exited go to the free lists and
        are deleted (those still listing C API blocks once these are freed). Returns whether
        any block moved."""
        return self._mag_sweep(True)

    cdef void _mag_want(self, size_t size, StreamKey s) noexcept nogil:
        """Under the pool's lock, before the pool grows for size bytes on s: a block another
        thread holds that would fit, on another stream, makes that stream wanted, as a free
        block of it would (so_take): when it next allocates, its thread gives it up."""
        cdef Magazine* m
        cdef size_t k
        cdef int i
        self._sweeps[SWEEP_WANT] += 1
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            if m.nblocks == 0:
                continue
            m.mutex.lock()
            for i in range(m.nblocks):
                if m.blocks[i].size >= size and not same_stream(m.blocks[i].stream, s):
                    so_mark_stream(&self._order, m.blocks[i].stream)
            m.mutex.unlock()

    cdef void _mag_give_up(self, StreamKey s) noexcept nogil:
        """Under the pool's lock: stream s is wanted and allocating on the calling thread,
        whose blocks held on s go to the free lists (to get their events there)."""
        cdef Magazine* m = self.thread_magazine(False)
        if m == NULL or m.nblocks == 0:
            return
        m.mutex.lock()
        self._mag_drop_stream(m, s)
        m.mutex.unlock()

    cdef bint _mag_drop_stream(self, Magazine* m, StreamKey s) noexcept nogil:
        """Under the pool's lock and m's: m's blocks held on s to the free lists; whether any
        went."""
        cdef bint dropped = False
        cdef int i = m.nblocks
        while i:
            i -= 1
            if same_stream(m.blocks[i].stream, s):
                self._mag_drop(m, i)
                dropped = True
        return dropped

    cdef bint mag_put(self, Block* b, StreamKey s) noexcept nogil:
        """Hold freed block b (last used on s) in the calling thread's magazine, without
        the pool's lock when it has room. False: b is not for a magazine (a region's, used
        on other streams, large) or the thread has none: the shared path."""
        cdef Magazine* m
        if b.size > MAG_MAX or b.region.cache != NULL or b.extra_streams != NULL or RECORDING \
                or not MAGAZINES:
            return False
        m = self.thread_magazine(True)
        if m == NULL:
            return False
        if m.mutex.try_lock() or self._mag_wait(m, &m.free_waits):
            if m.nblocks < MAG_SLOTS:
                self._mag_hold(m, b, s)
                m.mutex.unlock()
                return True
            m.mutex.unlock()
        if self._holder == current_thread():
            return False                        # inside an upstream call: deferred
        # Full (or being flushed): the oldest held block goes to the free lists.
        self.lock()
        m.mutex.lock()
        if m.nblocks == MAG_SLOTS:
            self._mag_drop(m, 0)
        self._mag_hold(m, b, s)
        m.mutex.unlock()
        self.unlock()
        return True

    cdef void _mag_hold(self, Magazine* m, Block* b, StreamKey s) noexcept nogil:
        """Under m's lock: m holds b (room checked by the caller), its bytes credited."""
        b.stream = s
        b.holder = NULL
        b.used = self.counters.num_allocs   # last live now (sg_reclaim's cold blocks)
        b.state = HELD
        m.blocks[m.nblocks] = b
        m.since[m.nblocks] = m.misses
        m.nblocks += 1
        m.held += b.size
        m.credit += b.size
        m.frees += 1
        m.freed_bytes += b.size

    cdef void _mag_drop(self, Magazine* m, int i) noexcept nogil:
        """Under the pool's lock and m's: held block i goes to the free lists (joined)."""
        cdef Block* b = mg_remove(m, i)
        cdef size_t spent = b.size if m.credit >= b.size else m.credit
        m.credit -= spent
        self._bound -= spent
        self.counters.in_use -= b.size
        self.counters.cached += b.size
        self._put(b)

    cdef bint mag_free_handed(self, uintptr_t ptr, StreamKey s, bint* done) noexcept nogil:
        """C API free of ptr by the calling thread: if its magazine handed ptr out, free it
        (held when it may be, else through the shared path) and set done. False: not done.
        s.tag == BAD_STREAM_TAG: as last used on the block's own stream; OWN_HANDLE_TAG:
        resolved against the block (resolved_free_key); should that take a driver call (the
        free names another stream), it is made after the magazine's lock is let go, and the
        block is then freed as any other (release)."""
        cdef gp_thread* t = gp_this_thread()
        cdef Magazine* m
        cdef Block* b = NULL
        cdef int i
        done[0] = False
        if t.magazines[0].pool == <void*>self:
            m = <Magazine*>t.magazines[0].magazine
        else:
            m = self.thread_magazine(False)
        if m == NULL or m.nhanded == 0:
            return False
        if not m.mutex.try_lock() and not self._mag_wait(m, &m.free_waits):
            return False
        i = mg_find_handed(m, ptr)
        if i >= 0:
            b = mg_unhand(m, i)
            done[0] = True
            if s.tag == BAD_STREAM_TAG or (s.tag == OWN_HANDLE_TAG and
                                           s.handle == b.stream.handle):
                s = b.stream
            if (s.tag != OWN_HANDLE_TAG and m.nblocks < MAG_SLOTS and
                    b.extra_streams == NULL and not RECORDING):
                self._mag_hold(m, b, s)
                b = NULL
        m.mutex.unlock()
        if b != NULL:
            self.release(b, resolved_free_key(self.upstream, s, b.stream))
        return done[0]

    cdef Block* mag_find_handed_locked(self, uintptr_t ptr, bint remove) noexcept nogil:
        """Under the pool's lock: the block at ptr handed out by any thread's magazine
        through the C API (taken off its list if remove); NULL if none."""
        cdef Magazine* m
        cdef Block* b = NULL
        cdef size_t k
        cdef int i
        self._sweeps[SWEEP_HANDED] += 1
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            m.mutex.lock()
            i = mg_find_handed(m, ptr)
            if i >= 0:
                b = mg_unhand(m, i) if remove else m.handed[i]
            m.mutex.unlock()
            if b != NULL:
                return b
        return NULL

    cdef void _mag_flush(self, Magazine* m) noexcept nogil:
        """Under the pool's lock and m's: every held block to the free lists, m's counts
        folded into the pool's counters."""
        while m.nblocks:
            self._mag_drop(m, m.nblocks - 1)
        self._mag_fold(m)

    cdef void _mag_fold(self, Magazine* m) noexcept nogil:
        self.counters.num_allocs += m.allocs
        self.counters.cache_hits += m.allocs
        self.counters.allocated_bytes += m.allocated_bytes
        self.counters.num_frees += m.frees
        self.counters.freed_bytes += m.freed_bytes
        m.allocs = m.frees = m.allocated_bytes = m.freed_bytes = 0

    cdef bint mag_flush_all(self) noexcept nogil:
        """Under the pool's lock: every thread's held blocks to the free lists; magazines
        of exited threads are deleted. Returns whether any block moved."""
        return self._mag_sweep(False)

    cdef bint _mag_sweep(self, bint exited_only) noexcept nogil:
        """Flush every magazine (exited_only: those of exited threads, whose flag is set once,
        under its lock, by the thread's exit) and delete those of exited threads that list no
        C API block."""
        cdef Magazine* m
        cdef bint moved = False
        cdef size_t k = 0
        while k < self._magazines.size():
            m = self._magazines[k]
            if exited_only and not m.orphan:
                k += 1
                continue
            m.mutex.lock()
            moved = moved or m.nblocks > 0
            self._mag_flush(m)
            if m.orphan and m.nhanded == 0:
                m.mutex.unlock()
                del m
                self._magazines.erase(self._magazines.begin() + k)
                continue
            m.mutex.unlock()
            k += 1
        return moved

    cdef void count_taken(self, size_t size) noexcept nogil:
        """Under the pool's lock: a block of size bytes handed out by the shared path."""
        count_acquired(&self.counters, size)
        self._bound += size
        if self._bound > self.counters.peak_in_use:
            self._settle_peak()

    cdef void _settle_peak(self) noexcept nogil:
        """Under the pool's lock, when the bound passed the peak: take back credit, each
        magazine it takes from kept locked until the end, in the order that least has a
        thread short of it next: the credit of threads that made no request since the last
        settle, then other threads' credit beyond their largest held block (a retake of one
        block never needs it), then the most credit first. Once the bound is back at the
        peak, bytes in use (at most the bound) are too, at that moment, with the locked
        magazines still: no peak went by unseen, and the other threads' magazines were not
        stopped. If all the credit does not do, every magazine is locked by then: bytes in
        use, exactly, raise the peak, and the credit above it goes. (Richest first alone had
        8 threads cycling through 5 sizes take each other's credit at every turn: issue 18.)"""
        cdef vector[pair[size_t, size_t]] order     # (credit, index), the most last
        cdef vector[char] locked
        cdef size_t k, j, n = self._magazines.size(), held = 0, in_use, spare, largest
        cdef size_t excess = self._bound - self.counters.peak_in_use     # > 0
        cdef Magazine* m
        self._sweeps[SWEEP_SETTLE] += 1
        locked.resize(n, 0)
        for k in range(n):                  # idle threads' credit (requests: a hint)
            m = self._magazines[k]
            if excess and m.credit and m.requests == m.settled:
                m.mutex.lock()
                locked[k] = 1
                excess = self._take_credit(m, m.credit, excess)
        for k in range(n):                  # credit no single retake needs
            m = self._magazines[k]
            if excess and not locked[k] and m.credit:
                m.mutex.lock()
                locked[k] = 1
                largest = mg_largest(m)
                spare = m.credit - largest if m.credit > largest else 0
                excess = self._take_credit(m, spare, excess)
        if excess:
            for k in range(n):
                order.push_back(pair[size_t, size_t](self._magazines[k].credit, k))  # a hint
            sort(order.begin(), order.end())
            j = n
            while j and excess:
                j -= 1
                k = order[j].second
                m = self._magazines[k]
                if not locked[k]:
                    m.mutex.lock()
                    locked[k] = 1
                excess = self._take_credit(m, m.credit, excess)
            if excess:
                # Every magazine is locked, its credit gone: the bound is bytes in use,
                # exactly.
                for k in range(n):
                    m = self._magazines[k]
                    if not locked[k]:
                        m.mutex.lock()
                        locked[k] = 1
                    self._mag_fold(m)
                    held += m.held
                in_use = self.counters.in_use - held
                if in_use > self.counters.peak_in_use:
                    self.counters.peak_in_use = in_use
        for k in range(n):
            m = self._magazines[k]
            m.settled = m.requests
            if locked[k]:
                m.mutex.unlock()

    cdef size_t _take_credit(self, Magazine* m, size_t most, size_t excess) noexcept nogil:
        """Under the pool's lock and m's: up to `most` of m's credit, and no more than
        excess, leaves the bound; the excess left."""
        cdef size_t back = excess if most >= excess else most
        m.credit -= back
        self._bound -= back
        return excess - back

    cdef size_t _freeze(self) noexcept nogil:
        """Under the pool's lock: lock every magazine, fold its counts; returns the bytes
        they hold. _thaw unlocks them."""
        cdef size_t k, held = 0
        cdef Magazine* m
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            m.mutex.lock()
            self._mag_fold(m)
            held += m.held
        return held

    cdef void _thaw(self) noexcept nogil:
        cdef size_t k
        for k in range(self._magazines.size()):
            self._magazines[k].mutex.unlock()

    cdef Counters counters_view(self) noexcept nogil:
        """Under the pool's lock: the counters as they are, the magazines' blocks counted as
        cached and their fast path's counts included."""
        cdef size_t held = self._freeze()
        cdef Counters c = self.counters
        self._thaw()
        c.in_use -= held
        c.cached += held
        return c

    cdef object raise_status(self, int status, size_t nbytes):
        if status == CUDA_ERROR_OUT_OF_MEMORY:
            self.counters.num_ooms += 1
            if RECORDING:
                self.lock()
                hist_oom(self.device, self._segments.pool_id, nbytes, self._oom_free_bytes(),
                         0)
                self.unlock()
            hist_flush_log()
            _logger.debug("gpupool: out of memory on device %d for %d B after the ladder: "
                          "raising OutOfMemoryError", self.device, nbytes)
            raise self._oom_error(nbytes)
        if status == GP_FORKED:
            raise GpupoolError(FORK_MESSAGE)
        if status == GP_REENTRANT:
            raise GpupoolError("the pool was used from inside its own upstream call")
        self.upstream.raise_error(status, "allocate")

    cdef object _oom_error(self, size_t nbytes):
        """The OutOfMemoryError of a failed request of nbytes, with the pool's numbers (read
        under the lock). It asks the upstream nothing: a driver call could fail or block where
        memory just ran out, so the device's free and total bytes stay None."""
        self.lock()
        c = self.counters_view()
        self.unlock()
        limit = self._segments.hard_limit or None
        where = f"; hard limit {format_bytes(limit)}" if limit else ""
        return OutOfMemoryError(
            f"gpupool: out of memory on device {self.device} allocating "
            f"{format_bytes(nbytes)} ({nbytes} B): {format_bytes(c.in_use)} in use, "
            f"{format_bytes(c.reserved)} reserved, {format_bytes(c.cached)} cached "
            f"by the pool and its regions{where}. Free buffers you no longer need, "
            f"release regions (region.release()), or register a callback with gpupool.on_oom; "
            f"gpupool.pool_status() shows the device's free memory.",
            requested_bytes=nbytes, in_use_bytes=c.in_use, reserved_bytes=c.reserved,
            cached_bytes=c.cached, limit_bytes=limit)

    cdef size_t _oom_free_bytes(self) noexcept nogil:
        """What the pool may still reserve under its hard limit (0 without one), for the
        memory history's out-of-memory entry: as for the error, no driver call is made."""
        cdef size_t limit = self._segments.hard_limit, reserved = self.counters.reserved
        return limit - reserved if limit > reserved else 0

    def _oom_message(self, size_t nbytes):
        """The message of the OutOfMemoryError of a failed request of ``nbytes`` (for
        ``gpupool.torch``, which raises its own type with it)."""
        return str(self._oom_error(nbytes))

    # Freeing ----------------------------------------------------------------------------

    cdef void release(self, Block* b, StreamKey s) noexcept nogil:
        """Take back a live block last used on s; with or without the GIL."""
        if FORKED[0]:
            return
        if self.mag_put(b, s):
            return
        if self._mutex.try_lock():
            self._holder = current_thread()
        elif self._holder == current_thread():
            # The holder is this thread (a collection run inside the pool's upstream call).
            b.stream = s
            self._deferred.push_back(b)
            return
        else:
            self._wait()
            self._holder = current_thread()
        self.release_locked(b, s)
        self.unlock()

    cdef void release_locked(self, Block* b, StreamKey s) noexcept nogil:
        cdef size_t i, size = b.size
        cdef uintptr_t e
        if hist_on(RECORDING):
            hist_free(self.device, self._segments.pool_id, b.ptr, size, s.handle)
        b.stream = s
        b.holder = NULL
        if b.extra_streams != NULL:
            for i in range(b.extra_streams.size()):
                if same_stream(b.extra_streams[0][i], s):
                    continue
                e = so_event(&self._order, self.upstream)
                if e and self.upstream.event_record(e, b.extra_streams[0][i].handle) == 0:
                    if b.extra_events == NULL:
                        b.extra_events = new vector[uintptr_t]()
                    b.extra_events.push_back(e)
                else:
                    # No event: the use is ordered by a device synchronize instead (the
                    # block must not be reused before that stream's work).
                    if e:
                        self._order.events.push_back(e)
                    self.upstream.clear_error()
                    if self.upstream.synchronize() != 0:
                        self.upstream.clear_error()
            del b.extra_streams
            b.extra_streams = NULL
        rc_own(rc_freed_into(b), b)         # its region's cache, or the pool's
        b.used = self.counters.num_allocs   # last live now (sg_reclaim's cold blocks)
        self._park(b)                       # may put a parked block: size was kept above
        count_released(&self.counters, size)
        self._bound -= size

    cdef void add_stream(self, Block* b, StreamKey s) noexcept nogil:
        """Record a use of the live block b on stream s (record_stream), once per stream; a
        per-thread stream is recorded as the legacy one (use_key), since any thread may free
        the block. The stream the block is freed on is skipped then (release_locked): the
        block's stream is not known here, a buffer may have moved since it was acquired."""
        cdef size_t i
        s = use_key(s)
        self.lock()
        if b.extra_streams == NULL:
            b.extra_streams = new vector[StreamKey]()
        for i in range(b.extra_streams.size()):
            if same_stream(b.extra_streams[0][i], s):
                break
        else:
            b.extra_streams.push_back(s)
        self.unlock()

    # Regions ----------------------------------------------------------------------------

    cdef void region_register(self, RegionCache* rc) noexcept nogil:
        self.lock()
        rc.pool = <void*>self
        self._regions.push_back(rc)
        self.unlock()

    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil:
        """Make rc the region of every thread (enter) or stop; False if another one is."""
        cdef bint ok = True
        self.lock()
        if enter:
            ok = self._process_region == NULL
            if ok:
                self._process_region = rc
        elif self._process_region == rc:
            self._process_region = NULL
        self.unlock()
        return ok

    cdef void region_unregister(self, RegionCache* rc) noexcept nogil:
        """Forget a region: its live blocks return to the pool when freed, its cache now."""
        cdef size_t i
        self.lock()
        if self._process_region == rc:
            self._process_region = NULL
        while rc.live_head != NULL:
            rc_detach(rc.live_head)
        rc_drain(rc)
        for i in range(self._regions.size()):
            if self._regions[i] == rc:
                self._regions.erase(self._regions.begin() + i)
                break
        self.unlock()

    cdef void region_enter(self, RegionCache* rc, bint entry) noexcept nogil:
        """rc is entered on one more thread; entry: a new entry (its blocks used from now on
        are stamped with it)."""
        self.lock()
        rc.entered += 1
        if entry:
            rc.entries += 1
        self.unlock()

    cdef void region_leave(self, RegionCache* rc) noexcept nogil:
        """rc is entered on one thread fewer; once on none, its cached blocks that the entry
        did not use go back to the pool."""
        self.lock()
        rc.entered -= 1
        if rc.entered == 0:
            self.flush_parked()
            rc_return_unused(rc)
        self.unlock()

    cdef void region_drain(self, RegionCache* rc) noexcept nogil:
        """Every cached block of a region goes back to the pool."""
        rc_drain(rc)

    # Trimming ---------------------------------------------------------------------------

    cdef size_t trim_locked(self) noexcept nogil:
        """Give the pool's cached memory back (sg_trim); returns the bytes given back."""
        self.mag_flush_all()
        self.flush_parked()
        return sg_trim(&self._segments, self.upstream, &self.counters, &self._order,
                       &self._free)

    cdef void trim_logged(self, LogKind kind, size_t bound) noexcept nogil:
        """trim_locked for a reason the debug log names (kind; bound: the limit crossed)."""
        hist_log(kind, self.device, bound, self.trim_locked(), 0)

    cdef int merge_streams_locked(self, size_t* moved) noexcept nogil:
        cdef int r = self.upstream.synchronize()
        if r != 0:
            return r
        self._order.wanted.clear()
        self.mag_flush_all()
        self.flush_parked()
        sg_merge_streams(&self._segments, &self._order, &self._free, moved)
        return 0

    # Python API -------------------------------------------------------------------------

    def allocate(self, nbytes, stream=None):
        """Allocate ``nbytes`` of device memory for use on ``stream``.

        Parameters
        ----------
        nbytes : int
            Size in bytes, >= 0. Zero gives an empty buffer with pointer 0.
        stream : int, stream object or None
            The stream the buffer will be used on: an int ``CUstream`` handle, None for the
            legacy default stream, or an object with ``__cuda_stream__``, ``.cuda_stream``,
            ``.ptr`` or ``.handle``. The block is ready for work submitted to ``stream``
            (stream-ordered: earlier users on other streams are complete).

        Returns
        -------
        DeviceBuffer
            Owns the block; the block returns to the pool (or the current region) when the
            buffer's last reference goes or it is closed. The pointer is 256-byte aligned.

        Raises
        ------
        TypeError, ValueError
            ``nbytes`` not an integer, negative or absurd; bad ``stream``.
        OutOfMemoryError
            The upstream is out of memory after the out-of-memory ladder: the pool releases
            its cached blocks, then every region's, then runs the ``on_oom`` callbacks,
            retrying after each step.
        CudaError, GpupoolError
            A driver failure (among them ``cuStreamGetId`` refusing a handle that names no
            live stream, or the upstream's own error for it), or a pool inherited through
            ``fork()``.
        """
        cdef uintptr_t handle = 0 if stream is None else stream_handle(stream)
        return self.allocate_key(nbytes, self.checked_key(handle))

    cdef object allocate_key(self, object nbytes, StreamKey key):
        """``allocate`` once the stream is resolved to its key: checks ``nbytes``, takes the
        block (the calling thread's current region first), runs the ``on_oom`` callbacks
        and retries once, raises as ``allocate`` does, and wraps the block in a
        DeviceBuffer. The C-level entry of the adapters that build their own wrappers."""
        cdef size_t n
        cdef Block* b = NULL
        cdef RegionCache* rc
        cdef int r
        cdef bint retried = False
        if type(nbytes) is int and 0 < <object>nbytes <= MAX_NBYTES:
            n = nbytes
        else:
            n = check_nbytes(nbytes)
            if n == 0:
                return new_buffer(self, NULL, 0, key)
        while True:             # one call of acquire, which the compiler then inlines
            r = self.acquire(n, key, &b)
            if retried:
                hist_log(LOG_CALLBACK_RETRY, self.device, n, 0, r)
            if r != CUDA_ERROR_OUT_OF_MEMORY or retried or not run_oom_callbacks(self, n):
                break
            retried = True      # after the on_oom callbacks, once
        if r != 0:
            self.raise_status(r, n)
        buf = new_buffer(self, b, n, key)
        rc = <RegionCache*>b.region.cache
        if rc != NULL and rc.on_alloc != NULL:
            (<object>rc.on_alloc)(b.ptr)
        return buf

    def cached_blocks(self):
        """The pool's free blocks (not those cached by regions), for inspection and tests.

        Returns
        -------
        list of (int, int, bool)
            ``(device pointer, bytes, piece)`` by address; ``piece``: the block shares its
            upstream allocation with neighbours (it was cut from a larger block).
        """
        cdef vector[Block*] blocks
        cdef size_t i
        self.lock()
        self.mag_flush_all()
        self.flush_parked()
        fl_each(&self._free, &blocks)
        found = [(blocks[i].ptr, blocks[i].size,
                  blocks[i].seg_prev != NULL or blocks[i].seg_next != NULL)
                 for i in range(blocks.size()) if blocks[i].region.cache == NULL]
        self.unlock()
        return sorted(found)

    def _verify(self):
        """Check the pool's bookkeeping: segments tiled by their blocks, the free lists and
        the parked blocks, region tags and their byte counts, and the counters. Returns the
        problems found (an empty list when all is consistent). For tests: it walks every
        block under the lock."""
        cdef Segment* seg = self._segments.head
        cdef Block* b
        cdef Block* prev
        cdef uintptr_t pos
        cdef size_t live = 0, idle = 0, mapped = 0, nfree = 0, nparked = 0, nheld = 0, holes
        cdef size_t magazine_blocks = 0
        cdef size_t i
        cdef RegionCache* rc
        problems, tagged, counted = [], {}, {}
        self.lock()
        self._mag_reap()
        while seg != NULL:
            pos, b, holes = seg.base, seg.first, 0
            prev = NULL
            while b != NULL:
                if b.ptr != pos or b.seg_prev != prev or b.segment != seg:
                    problems.append(f"segment {seg.base:#x}: block {b.ptr:#x} out of place")
                    break
                if b.state == LIVE:
                    live += b.size
                elif b.state == FREE or b.state == PARKED or b.state == HELD:
                    idle += b.size
                    nfree += b.state == FREE
                    nparked += b.state == PARKED
                    nheld += b.state == HELD
                    if b.region.cache != NULL:
                        key = <uintptr_t>b.region.cache
                        tagged[key] = tagged.get(key, 0) + b.size
                elif b.state == UNMAPPED:
                    holes += b.size
                pos += b.size
                prev = b
                b = b.seg_next
            if seg.last != prev or pos != seg.base + seg.nbytes:
                problems.append(f"segment {seg.base:#x}: its blocks end at {pos:#x}, "
                                f"it at {seg.base + seg.nbytes:#x}")
            mapped += seg.nbytes - holes
            seg = seg.next
        c = self.counters_view()
        for i in range(self._magazines.size()):
            magazine_blocks += self._magazines[i].nblocks
        if nheld != magazine_blocks:
            problems.append(f"{nheld} held blocks, magazines hold {magazine_blocks}")
        if c.peak_in_use < c.in_use or self._bound > c.peak_in_use or self._bound < c.in_use:
            problems.append(f"bytes in use {c.in_use}, bound {self._bound}, peak "
                            f"{c.peak_in_use}: not in use <= bound <= peak")
        if (c.reserved, c.cached, c.in_use) != (mapped, idle, live):
            problems.append(f"counters reserved/cached/in use {c.reserved}/{c.cached}/"
                            f"{c.in_use}, blocks {mapped}/{idle}/{live}")
        if nfree != self._free.nblocks or nparked != <size_t>self._nparked:
            problems.append(f"{nfree} free and {nparked} parked blocks, lists hold "
                            f"{self._free.nblocks} and {self._nparked}")
        for i in range(self._regions.size()):
            rc = self._regions[i]
            b = rc.cached_head
            n = 0
            while b != NULL:
                n += b.size
                b = b.region.next
            counted[<uintptr_t>rc] = n
            if n != rc.cached_bytes or n != tagged.get(<uintptr_t>rc, 0):
                problems.append(f"region {<uintptr_t>rc:#x}: cached_bytes {rc.cached_bytes},"
                                f" its list {n}, tagged blocks {tagged.get(<uintptr_t>rc, 0)}")
        if set(tagged) - set(counted):
            problems.append("free blocks tagged with a region the pool does not know")
        self.unlock()
        return problems

    def _magazines_info(self):
        """Every thread's magazine for this pool, for tests and diagnostics: a list of dicts
        with ``blocks`` (held free blocks), ``held`` and ``credit`` (bytes), ``handed`` (C
        API blocks taken from it, live), ``orphan`` (its thread exited), ``allocs`` and
        ``frees`` (served by it without the pool's lock, not yet folded into the pool's
        counters), ``misses`` (its thread's requests it could not serve, with no free block of
        the exact size either), and why requests took the shared path while it held blocks:
        ``wanted`` (another stream waits for blocks of its stream, or more than WANTED_FAST
        streams are waited for and its bit is in the mask), ``no_block`` (none of the size on
        the stream), ``no_credit`` (one, but too little credit: the pool's peak bound) and
        ``no_hand`` (one, but MAG_HANDED C API blocks are out); why they took it otherwise:
        ``empty`` (it held no block); ``waits`` and ``free_waits`` (its lock was another
        thread's at that moment, and a request or a free waited for it); and ``streams``, each
        held block's (size, stream handle, stream tag)."""
        cdef Magazine* m
        cdef size_t k
        cdef int i
        out = []
        self.lock()
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            m.mutex.lock()
            out.append({"blocks": m.nblocks, "held": m.held, "credit": m.credit,
                        "handed": m.nhanded, "orphan": bool(m.orphan), "allocs": m.allocs,
                        "frees": m.frees, "misses": m.misses, "wanted": m.wanted,
                        "no_block": m.no_block, "no_credit": m.no_credit,
                        "no_hand": m.no_hand, "empty": m.empty, "waits": m.waits,
                        "free_waits": m.free_waits,
                        "streams": [(m.blocks[i].size, m.blocks[i].stream.handle,
                                     m.blocks[i].stream.tag) for i in range(m.nblocks)]})
            m.mutex.unlock()
        self.unlock()
        return out

    def _sweep_counts(self):
        """How often the pool's lock holder swept every magazine, for diagnostics (issue 18):
        a dict of counts since the pool was made, ``others`` (a request found no free block of
        its size and looked at idle threads' magazines), ``want`` (before the pool grew),
        ``handed`` (a C API free not in the pool's table: another thread's magazine, or its
        own when the wait for its lock ran out) and ``settle`` (the peak bound passed: credit taken
        back)."""
        self.lock()
        out = {"others": self._sweeps[SWEEP_OTHERS], "want": self._sweeps[SWEEP_WANT],
               "handed": self._sweeps[SWEEP_HANDED], "settle": self._sweeps[SWEEP_SETTLE]}
        self.unlock()
        return out

    def _counters(self):
        """The counters record as a dict (bytes and counts), read under the lock (and every
        thread's magazine's)."""
        self.lock()
        self._mag_reap()                # exited threads' magazines: not read again and again
        c = self.counters_view()
        self.unlock()
        return c

    def stats(self):
        """Current counters as a :class:`gpupool.PoolStats` (bytes and counts)."""
        return PoolStats.from_counters(self._counters())

    def memory_stats(self):
        """Counters under the keys of ``torch.cuda.memory_stats()``, for existing dashboards.

        Returns
        -------
        dict
            ``allocated_bytes.all.{current,peak,allocated,freed}`` and
            ``active_bytes.all.{current,peak}`` (bytes of live blocks, by size class),
            ``reserved_bytes.all.{current,peak}``, ``allocation.all.{current,allocated,freed}``
            (counts), ``segment.all.{current,allocated,freed}`` (upstream allocations),
            ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free``.
            gpupool keeps no per-pool ("small_pool"/"large_pool") split.
        """
        return torch_memory_stats(self._counters())

    def reset_peak_stats(self):
        """Set the peaks of bytes in use and reserved to their current values."""
        self.lock()
        self.reset_peaks_locked()
        self.unlock()

    cdef void reset_peaks_locked(self) noexcept nogil:
        """Under the pool's lock: the peaks of bytes in use and reserved are the current
        values (bytes in use exactly: every magazine read, their credit taken back)."""
        cdef size_t k
        self.counters.peak_in_use = self.counters.in_use - self._freeze()
        for k in range(self._magazines.size()):
            self._magazines[k].credit = 0       # the bound is bytes in use again
        self._bound = self.counters.peak_in_use
        self._thaw()
        self.counters.peak_reserved = self.counters.reserved

    cdef size_t largest_held(self) noexcept nogil:
        """Under the pool's lock: the largest block any thread's magazine holds."""
        cdef size_t k, largest = 0, size
        cdef Magazine* m
        for k in range(self._magazines.size()):
            m = self._magazines[k]
            m.mutex.lock()
            size = mg_largest(m)
            m.mutex.unlock()
            if size > largest:
                largest = size
        return largest

    def merge_streams(self):
        """Make every cached block, of the pool and of its regions, free for any stream.

        A block freed on a stream goes to another stream only once an event recorded on its
        stream after the free reports complete, and that event is recorded when its stream
        next allocates: blocks of a stream that went idle stay with it. This synchronizes the
        device once (``cuCtxSynchronize``: the host waits for all queued work), then merges
        every stream's free lists, keeping the memory (``trim`` gives it back instead). Call
        it at a point where the host waits anyway, such as the end of an epoch.

        Returns
        -------
        int
            Blocks that were bound to a stream and are now free for all.

        Raises
        ------
        CudaError
            The synchronize failed.
        GpupoolError
            The pool was inherited through ``fork()``.
        """
        cdef size_t moved = 0
        cdef int r
        if FORKED[0]:
            self.raise_status(GP_FORKED, 0)
        self.lock()
        r = self.merge_streams_locked(&moved)
        self.unlock()
        self.upstream.raise_error(r, "synchronize")
        return moved

    def trim(self):
        """Give the pool's cached memory back to the upstream: every wholly free segment.

        Blocks cached by regions stay with their regions (``Region.release()`` returns them).
        Synchronizes the device first when a cached block may still be in use by queued work.
        On an expandable upstream every whole free page is unmapped.

        Returns
        -------
        int
            Bytes released (also logged to the ``"gpupool"`` logger at DEBUG).
        """
        cdef int r
        if FORKED[0]:
            self.raise_status(GP_FORKED, 0)
        self.lock()
        released = self.trim_locked()
        r = self.upstream.trim()
        reserved = self.counters.reserved
        self.unlock()
        hist_flush_log()
        _logger.debug("gpupool: trim released %d B on device %d (%d B reserved now)",
                      released, self.device, reserved)
        self.upstream.raise_error(r, "trim")
        return released

    def mem_info(self):
        """``(free, total)`` bytes of the device (``cuMemGetInfo``)."""
        cdef size_t f = 0, t = 0
        self.upstream.raise_error(self.upstream.mem_info(&f, &t), "cuMemGetInfo")
        return f, t

    @property
    def hard_limit(self):
        """Bytes the pool never exceeds in reserved memory; None when unlimited."""
        return self._segments.hard_limit or None

    @property
    def soft_limit(self):
        """Reserved bytes above which cached blocks are released; None when unlimited."""
        return self._soft_limit or None

    def __reduce__(self):
        raise not_picklable(
            "a gpupool.Pool", "make the pool where it is used (gpupool.get_pool(), or "
            "gpupool.Pool(...) in the other process) and pickle buffers: they carry their bytes")

    def __repr__(self):
        c = self._counters()
        return (f"<gpupool.Pool device={self.device} upstream={self.upstream!r} "
                f"in_use={c['in_use']} reserved={c['reserved']}>")


cdef void reclaim_magazine(gp_thread_magazine* slot) noexcept nogil:
    """The calling thread deletes its magazine in slot, whose pool is gone, and frees the
    slot. Its lock is taken first: the pool's dealloc may still be letting go of it."""
    cdef Magazine* m = <Magazine*>slot.magazine
    m.mutex.lock()
    m.mutex.unlock()
    del m
    slot.pool = NULL
    slot.magazine = NULL


cdef void detach_magazine(Magazine* m) noexcept nogil:
    """The pool of m is going (under its lock): its blocks go with the pool's memory; m is
    deleted now if its thread exited, else by its thread (Pool.thread_magazine)."""
    cdef bint orphan
    m.mutex.lock()
    m.pool = NULL
    m.nblocks = m.nhanded = 0
    orphan = m.orphan
    m.mutex.unlock()
    if orphan:
        del m


cdef void magazine_thread_exit(void* p) noexcept nogil:
    """A thread with magazines exits: each is left to its pool (which flushes and deletes
    it when it next flushes), or deleted if its pool is gone."""
    cdef Magazine* m = <Magazine*>p
    cdef bint gone
    if FORKED[0]:
        return          # a fork() child: a lock may have been held at the fork; leave it all
    m.mutex.lock()
    gone = m.pool == NULL
    m.orphan = True
    m.mutex.unlock()
    if gone:
        del m


gp_magazine_exit_hook = magazine_thread_exit


cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1:
    """Run the on_oom callbacks (with the GIL); whether there were any to run. A callback
    that raises is logged and the others still run."""
    if not _oom_callbacks:
        return False
    pool.counters.oom_retries += 1
    hist_flush_log()
    _logger.debug("gpupool: out of memory on device %d for %d B: step 3, running %d on_oom "
                  "callbacks, then retrying", pool.device, nbytes, len(_oom_callbacks))
    for callback in list(_oom_callbacks):
        try:
            callback(nbytes)
        except Exception:
            logging.getLogger("gpupool").exception(
                "gpupool: the on_oom callback %r raised while memory for %d B was wanted on "
                "device %d; the other callbacks run and the allocation is retried",
                callback, nbytes, pool.device)
    return True


def on_oom(callback):
    """Register ``callback(nbytes)`` to run when an allocation fails for lack of memory.

    Callbacks run (in registration order, outside the pool's lock) after the pool has
    released its own and its regions' caches; the allocation is then retried once.
    ``gpupool.on_oom(lambda n: gc.collect())`` is the usual one. Returns ``callback`` so it
    can be used as a decorator.

    A callback that raises (an ``Exception``) does not replace the out-of-memory error: its
    exception is logged with its traceback to the ``"gpupool"`` logger
    (``logging.getLogger("gpupool")``), the other callbacks run and the allocation is retried;
    if the retry fails too, the ``OutOfMemoryError`` is raised as without the callback.

    Raises
    ------
    TypeError
        ``callback`` is not callable.
    """
    if not callable(callback):
        raise TypeError("on_oom needs a callable taking the requested nbytes")
    _oom_callbacks.append(callback)
    return callback


def remove_oom_callback(callback):
    """Unregister a callback added with :func:`on_oom` (its first registration, if it was
    registered more than once).

    Raises
    ------
    ValueError
        ``callback`` is not registered.
    """
    try:
        _oom_callbacks.remove(callback)
    except ValueError:
        raise ValueError(f"{callback!r} is not an on_oom callback: gpupool.remove_oom_callback "
                         f"takes a callable registered with gpupool.on_oom "
                         f"({len(_oom_callbacks)} registered now)") from None


include "snapshot.pxi"
