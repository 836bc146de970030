# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The pool: one device's caching allocator (docs/design.md has the contract).

A request is rounded to 512 bytes and served by best fit from the pool's free lists
(``_freelist.pxd``), in stream order (``_streamorder.pxd``): blocks cached by the region in
front of it (``_regioncache.pxd``) and the pool's own, then, before the pool grows, those of
idle regions. A larger block is cut and the rest stays free; a freed block joins its free
neighbours (``_segments.pxd``). Else the pool grows: a new segment of a plain upstream, or
more pages of the stream's expandable segment (``_segments.pxd``). When the upstream is out of
memory, the ladder: give this pool's cached memory back, retry; untag every region's cache
and give it back, retry; then the caller runs the ``on_oom`` callbacks and retries once more
before raising ``OutOfMemoryError``.

Everything runs under the pool's lock, taken without blocking other Python threads (the GIL
is released while waiting). A free made by the thread that holds the lock (a garbage
collection run by a Python upstream, say) is deferred until that thread unlocks.
"""
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool._block cimport Block, Segment, LIVE, FREE, PARKED, UNMAPPED
from gpupool._buffer cimport BlockOwner, DeviceBuffer, new_buffer
from gpupool._counters cimport count_acquired, count_released
from gpupool._driver cimport fork_flag
from gpupool._freelist cimport fl_each
from gpupool._handoff cimport use_key
from gpupool._history cimport (
    LogKind, LOG_LADDER_NOTHING, LOG_LADDER_TRIM, LOG_LADDER_REGIONS, LOG_CALLBACK_RETRY,
    LOG_SOFT_TRIM, LOG_STREAM_TRIM, hist_on, hist_subscribe, register_pool, hist_alloc,
    hist_free, hist_oom, hist_log, hist_flush_log,
)
from gpupool._regioncache cimport (
    RegionCache, rc_link, rc_detach, rc_own, rc_disown, rc_freed_into, rc_drain,
    rc_return_unused,
)
from gpupool._segments cimport (
    round_request, sg_put, sg_split, sg_grow_plain, sg_extend, sg_trim, sg_merge_streams,
    sg_release_all,
)
from gpupool._sizes cimport MAX_NBYTES, check_nbytes
from gpupool._status cimport GP_REENTRANT, GP_FORKED
from gpupool._streamorder cimport WANTED_MAX, so_event, so_take, so_mark_blocks, so_is_wanted
from gpupool._streams cimport (
    StreamKey, BAD_STREAM_TAG, STREAM_PER_THREAD, current_thread, same_stream, stream_key,
    created_stream_key, refused_stream_status, stream_handle,
)
from gpupool._upstream cimport Upstream, DriverUpstream, AsyncUpstream, VmmUpstream

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
# This module's copy of the memory history's switch (_history.pxd): nonzero while it records.
cdef int RECORDING = 0
hist_subscribe(&RECORDING)
_logger = logging.getLogger("gpupool")
# Blocks up to this size are parked (larger ones are joined at once: parking them changed the
# layout of the recorded GPT-2 traces for the worse, 8,292 -> 8,884 MiB at 64 MiB; up to
# 4 MiB every recorded trace kept its peak).
cdef size_t PARK_MAX = 4 << 20

include "_regionstack.pxi"


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
        from gpupool._ordinals import check_ordinal
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
        if FORKED[0] or self.upstream is None:
            return
        self._mutex.lock()
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
        self._holder = 0
        self._mutex.unlock()

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
        if FORKED[0]:
            return GP_FORKED
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
        cdef bint grew = False
        cdef int r
        if self._segments.hard_limit and size > self._segments.hard_limit:
            size = nbytes               # only the exact request fits under the limit
        if not self._order.wanted.empty():
            if self._order.wanted.size() > WANTED_MAX:
                # Many streams hold blocks that others want and never allocate again (most
                # likely destroyed): one synchronize frees their blocks for every stream.
                self.trim_logged(LOG_STREAM_TRIM, WANTED_MAX)
            else:
                self._answer_wanted(s)
        rc = current_cache(<void*>self, self._process_region)
        b = self._unpark(size, s, rc) if self._nparked else NULL
        if b != NULL:
            b.state = LIVE
            self.counters.cache_hits += 1
            if rc != NULL:
                rc_link(rc, b)
                rc.hits += 1
            count_acquired(&self.counters, b.size)
            out[0] = b
            return 0
        self.flush_parked()
        b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, False)
        if b == NULL:
            # Idle regions' cached blocks serve before the pool grows: a region never costs
            # memory that the pool alone would not.
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
        if b == NULL:
            r = self._grow(size, s, <void*>rc)
            if r != 0:
                return r
            grew = True
            b = so_take(&self._order, self.upstream, &self._free, size, s, <void*>rc, True)
            if b == NULL:
                return CUDA_ERROR_OUT_OF_MEMORY
        owner = rc_disown(b)
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
        count_acquired(&self.counters, b.size)
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

    cdef int _grow(self, size_t size, StreamKey s, void* owner) noexcept nogil:
        """Add memory for a request of size bytes on s (made through cache owner) to the free
        lists; then the ladder when the upstream is out of memory: this pool's cache, then
        every region's."""
        cdef int r = self._grow_once(size, s, owner)
        cdef size_t i, released
        if r == CUDA_ERROR_OUT_OF_MEMORY and not self.counters.cached:
            hist_log(LOG_LADDER_NOTHING, self.device, size, 0, r)
        if r == CUDA_ERROR_OUT_OF_MEMORY and self.counters.cached:
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
        if self.upstream.expandable:
            return sg_extend(&self._segments, self.upstream, &self.counters, &self._order,
                             &self._free, size, s, owner)
        return sg_grow_plain(&self._segments, self.upstream, &self.counters, &self._order,
                             &self._free, size, s)

    cdef void _answer_wanted(self, StreamKey s) noexcept nogil:
        """Stream s is allocating, so it is alive: if another stream waits for its free
        blocks, record their events now."""
        if so_is_wanted(&self._order, s):
            so_mark_blocks(&self._order, self.upstream, &self._free, s)

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
        c = self.counters
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
        self._park(b)                       # may put a parked block: size was kept above
        count_released(&self.counters, size)

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
        cdef size_t live = 0, idle = 0, mapped = 0, nfree = 0, nparked = 0, holes
        cdef size_t i
        cdef RegionCache* rc
        problems, tagged, counted = [], {}, {}
        self.lock()
        while seg != NULL:
            pos, b, holes = seg.base, seg.first, 0
            prev = NULL
            while b != NULL:
                if b.ptr != pos or b.seg_prev != prev or b.segment != seg:
                    problems.append(f"segment {seg.base:#x}: block {b.ptr:#x} out of place")
                    break
                if b.state == LIVE:
                    live += b.size
                elif b.state == FREE or b.state == PARKED:
                    idle += b.size
                    nfree += b.state == FREE
                    nparked += b.state == PARKED
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
        c = self.counters
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

    def _counters(self):
        """The counters record as a dict (bytes and counts), read under the lock."""
        self.lock()
        c = self.counters
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
        self.counters.peak_in_use = self.counters.in_use
        self.counters.peak_reserved = self.counters.reserved
        self.unlock()

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
        return (f"<gpupool.Pool device={self.device} upstream={self.upstream!r} "
                f"in_use={self.counters.in_use} reserved={self.counters.reserved}>")


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


include "_snapshot.pxi"
