# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The pool: one device's caching allocator (docs/design.md has the contract).

A request is rounded to 512 bytes and served by best fit from the free lists
(``core/freelist.pxd``) in stream order (``core/streamorder.pxd``): the blocks cached by the
region in front of it (``core/regioncache.pxd``), the pool's own, then idle regions'. A larger
block is cut and a freed block joins its free neighbours (``core/cutjoin.pxd``). Else the pool
grows (``core/growplain.pxd``, ``core/growexpand.pxd``); out of memory, the ladder
(``core/ladder.pxd``) gives cached memory back and retries, then the caller runs the
``on_oom`` callbacks (``core/oom.pyx``) and retries once more before raising
``OutOfMemoryError``. Everything runs under the pool's lock (``core/lock.pxd``), taken without
blocking other Python threads; a free made by the thread holding it is deferred to its unlock.
"""
from libc.stdint cimport uintptr_t, SIZE_MAX
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.driver.calls cimport fork_flag
from gpupool.driver.status cimport GP_REENTRANT, GP_FORKED, GP_ASLEEP
from gpupool.records.block cimport Block, Segment, LIVE, UNMAPPED
from gpupool.records.ptrtable cimport pt_insert
from gpupool.records.sizes cimport MAX_NBYTES, check_nbytes
from gpupool.records.streams cimport (
    StreamKey, current_thread, key_status, resolve_free, same_stream, stream_handle,
)
from gpupool.history.ring cimport (
    LOG_CALLBACK_RETRY, hist_on, hist_subscribe, hist_alloc, hist_oom, hist_log, hist_flush_log,
)
from gpupool.buffer.device_buffer cimport DeviceBuffer, new_buffer
from gpupool.buffer.handoff cimport use_key
from gpupool.core.magazine cimport Magazine
from gpupool.core.cutjoin cimport sg_drain, sg_return_unused
from gpupool.core.parking cimport pk_flush
from gpupool.core.ladder cimport ld_trim
from gpupool.core.regioncache cimport (
    RegionCache, Lane, rc_detach, rc_find_live, rc_slow_path,
)
from gpupool.core.lane cimport ln_take, ln_put
from gpupool.core.planned cimport pl_call
from gpupool.core.plantable cimport PW_SLOW_PATH, PW_ONLINE
from gpupool.core.segments cimport round_request
from gpupool.core.acquire cimport ps_acquire_locked
from gpupool.core.fastpath cimport (
    fp_thread_magazine, fp_take, fp_put, fp_free_handed, fp_thread_exit, fp_is_wanted,
)
from gpupool.core.lock cimport ps_lock, ps_locked, ps_wait
from gpupool.core.free cimport ps_free_locked, ps_unlock, ps_drop_region
from gpupool.core.thread cimport (
    GP_REGION_DEPTH_MAX, gp_thread, gp_this_thread, gp_magazine_exit_hook, uncached_mark,
    thread_cache, is_current_cache,
)
from gpupool.core.handed cimport hd_find, hd_cache_info
from gpupool.core.regionexit cimport rg_exit
from gpupool.core.turns cimport rt_entered
from gpupool.core.oom cimport OomFacts, oom_run_callbacks, oom_error, oom_gather, oom_headroom
from gpupool.core.poolbase cimport PoolBase

import logging
import os

from gpupool.errors import FORK_MESSAGE, REENTRANT_MESSAGE, GpupoolError
from gpupool.upstream.python import PythonUpstream

cdef const int* FORKED = fork_flag()
# This module's copy of the memory history's switch (history/ring.pxd): nonzero while it records
# (magazines are passed by then, so that every allocation and free is recorded).
cdef int RECORDING = 0
hist_subscribe(&RECORDING)
_logger = logging.getLogger("gpupool")
# GPUPOOL_MAGAZINES=0 (read at import): no thread keeps freed blocks in a magazine; every free
# and request takes the shared path. For memory measurements across threads (PyTorch's
# autograd thread allocates while the main thread's magazine holds what it freed).
cdef bint MAGAZINES = os.environ.get("GPUPOOL_MAGAZINES", "").strip() != "0"
# GPUPOOL_LANES=0 (read at import; _set_lanes for tests): thread-scope planned regions made from
# then on have no lane (core/lane.pxd): their pairs take the shared path.
cdef bint LANES = os.environ.get("GPUPOOL_LANES", "").strip() != "0"


def _set_lanes(bint on):
    """Whether regions made from now on get a lane (core/lane.pxd); returns the setting before.
    For tests and A/B measurements."""
    global LANES
    before, LANES = LANES, on
    return before


include "regionstack.pxi"
include "tagging.pxi"

# The docstring opens with its signature, for inspect.signature (Note [Class signatures]).
cdef class Pool(PoolBase):
    """Pool(device=0, upstream=None, hard_limit=None, soft_limit=None)
--

    A caching pool of device memory on one device.

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
        Bytes the pool may reserve (hard: never exceeded, whole pages on an expandable
        upstream; soft: cached blocks are released when exceeded): an int or a string such
        as ``"512MiB"``, ``"8GB"``, ``"50%"``; default ``GPUPOOL_{HARD,SOFT}_LIMIT``.

    Raises
    ------
    NoDeviceError
        No driver or no such device (driver upstreams).
    ValueError, TypeError
        An impossible ``device`` (negative, not an int: before any driver call), a malformed
        limit (naming its argument or variable), a soft limit above the hard one, a hard
        limit below 512 B (a page, expandable) or a malformed upstream (``GPUPOOL_UPSTREAM``).
    """

    def __cinit__(self, *args, **kwargs):
        # PoolBase.__cinit__ (core/poolbase.pyx) has made the state from the arguments; the
        # memory history's switch it reads is this module's copy.
        self._st.segments.recording = &RECORDING

    # Locking --------------------------------------------------------------------------

    cdef void lock(self) noexcept nogil:
        ps_lock(&self._st)

    cdef void unlock(self) noexcept nogil:
        ps_unlock(&self._st, self.upstream)

    # Allocation -----------------------------------------------------------------------

    cdef StreamKey check_stream(self, uintptr_t handle) except *:
        """The stream's key, raising the driver's error for a handle it refuses (not a
        stream, or a destroyed one): for allocations and stream changes, where a bad handle
        is the caller's mistake."""
        cdef StreamKey key
        cdef int r = key_status(self.upstream, handle, &key)
        if r != 0:
            self.upstream.raise_error(r, f"cuStreamGetId (stream handle {handle:#x})")
        return key

    cdef int acquire(self, size_t nbytes, StreamKey s, Block** out, int way) noexcept nogil:
        """Take a block for nbytes > 0 used on stream s (way: a PlanWay, as
        ps_acquire_locked's). Returns 0 or a status code."""
        cdef int r
        cdef Block* b
        if FORKED[0]:
            return GP_FORKED
        b = self.fast_take(nbytes, s, way)
        if b != NULL:
            out[0] = b
            return 0
        if self._st.lock_thread == current_thread():
            return GP_REENTRANT
        self.lock()
        r = self.acquire_locked(nbytes, s, out, way)
        if hist_on(RECORDING) and r == 0:
            hist_alloc(self.device, self._st.segments.pool_id, out[0].ptr, nbytes, s.handle)
        self.unlock()
        return r

    cdef int acquire_locked(self, size_t nbytes, StreamKey s, Block** out, int way) noexcept nogil:
        return ps_acquire_locked(&self._st, self.upstream, <void*>self, nbytes, s, out, way)

    # Magazines (core/magazine.pxd) ---------------------------------------------------------

    cdef Magazine* thread_magazine(self, bint make) noexcept nogil:
        return fp_thread_magazine(&self._st, self.upstream, <void*>self, make)

    cdef Block* fast_take(self, size_t nbytes, StreamKey s, int way) noexcept nogil:
        """A block for nbytes on s without the pool's lock: from the lane of the calling
        thread's region when it is in one (a thread-scope planned region's: core/lane.pxd),
        else from its magazine (mag_take); NULL: take the shared path (as always while the
        memory history records, for a tagged request, or when other streams wait for s's
        blocks)."""
        cdef gp_thread* t = gp_this_thread()
        cdef RegionCache* rc = thread_cache(t, <void*>self, self._st.process_region)
        if rc == NULL or rc.lane == NULL:      # (a region's: NULL, its magazine's counts kept)
            return fp_take(&self._st, <void*>self, t, rc != NULL, nbytes, s, False, RECORDING)
        if way != PW_SLOW_PATH or RECORDING or t.tag or fp_is_wanted(&self._st, s):
            return NULL
        return ln_take(rc, round_request(nbytes), s)

    cdef Block* mag_take(self, size_t nbytes, StreamKey s, bint capi) noexcept nogil:
        """A block for nbytes on s from the calling thread's magazine, without the pool's
        lock (core/fastpath.pxd); NULL: take the shared path. capi: list it as handed (the C
        API frees by pointer)."""
        cdef gp_thread* t = gp_this_thread()
        return fp_take(&self._st, <void*>self, t,
                       thread_cache(t, <void*>self, self._st.process_region) != NULL,
                       nbytes, s, capi, RECORDING)

    cdef bint mag_put(self, Block* b, StreamKey s) noexcept nogil:
        """Hold freed block b (last used on s) in the calling thread's magazine; False: the
        shared path."""
        return fp_put(&self._st, self.upstream, <void*>self, b, s, RECORDING, MAGAZINES)

    cdef bint mag_free_handed(self, uintptr_t ptr, StreamKey s, bint* done) noexcept nogil:
        """C API free of ptr by the calling thread: if its magazine handed ptr out, free it
        (held when it may be, else through the shared path, once its stream is resolved:
        resolve_free) and set done (core/fastpath.pxd, fp_free_handed). False: not
        done."""
        cdef Block* b = fp_free_handed(&self._st, <void*>self, ptr, &s, RECORDING, done)
        if b != NULL:
            self.free_block(b, resolve_free(self.upstream, s, b.stream))
        return done[0]

    cdef object raise_status(self, int status, size_t nbytes):
        if status == CUDA_ERROR_OUT_OF_MEMORY:
            self._st.counters.num_ooms += 1
            if RECORDING:
                self.note_oom(nbytes, 0)
            hist_flush_log()
            _logger.debug("gpupool: out of memory on device %d for %d B after the ladder: "
                          "raising OutOfMemoryError", self.device, nbytes)
            raise self._oom_error(nbytes)
        if status == GP_FORKED:
            raise GpupoolError(FORK_MESSAGE)
        if status == GP_REENTRANT:
            raise GpupoolError(REENTRANT_MESSAGE)
        if status == GP_ASLEEP:
            raise asleep_here()
        self.upstream.raise_error(status, "allocate")

    cdef object _oom_error(self, size_t nbytes):
        """The OutOfMemoryError of a failed request of nbytes (core/oom.pyx, oom_error)."""
        cdef OomFacts f
        self.lock()
        oom_gather(&self._st, self.upstream, self.thread_magazine(False), nbytes, &f)
        self.unlock()
        return oom_error(self.device, self._st.segments.pool_id,
                         not isinstance(self.upstream, PythonUpstream), &f, nbytes)

    def _oom_message(self, size_t nbytes):
        """The message of the OutOfMemoryError of a failed request of ``nbytes`` (for
        ``gpupool.torch``, which raises its own type with it)."""
        return str(self._oom_error(nbytes))

    # Freeing ----------------------------------------------------------------------------

    cdef void free_block(self, Block* b, StreamKey s) noexcept nogil:
        """Take back a live block last used on s; with or without the GIL."""
        cdef RegionCache* rc = <RegionCache*>b.region.cache
        if FORKED[0]:
            return
        if rc != NULL:
            # A buffer's block of the calling thread's region, into its lane (core/lane.pxd;
            # the C API's, holder NULL, would only pass through: its requests take none).
            if not RECORDING and b.holder != NULL and \
                    is_current_cache(rc, <void*>self, self._st.process_region) and \
                    rc.lane != NULL and ln_put(rc, b, s):
                return                  # (rc is read only once it is the thread's: alive)
        elif self.mag_put(b, s):
            return
        if self._st.mutex.try_lock():
            ps_locked(&self._st)
        elif self._st.lock_thread == current_thread():
            # The lock_thread is this thread (a collection run inside the pool's upstream call).
            # Its buffer dies now: nothing may read it through the block until the unlock.
            b.stream = s
            b.holder = NULL
            self._st.deferred.push_back(b)
            return
        else:
            ps_wait(&self._st)
            ps_locked(&self._st)
        self.free_locked(b, s)
        self.unlock()

    cdef void free_locked(self, Block* b, StreamKey s) noexcept nogil:
        ps_free_locked(&self._st, self.upstream, b, s)

    cdef void add_stream(self, Block* b, StreamKey s, void* holder) noexcept nogil:
        """Record a use of the live block b on stream s (record_stream), once per stream; a
        per-thread stream is recorded as the legacy one (use_key), since any thread may free
        the block. The stream the block is freed on is skipped then (free_locked): the
        block's stream is not known here, a buffer may have moved since it was acquired.
        holder: the buffer that held b when the caller read it (NULL: no check, the C API's
        blocks have none). The wait for the lock lets the GIL go, and another thread may
        close that buffer meanwhile: a block no longer holder's is left as it is (freed, or
        another buffer's by now). On the lock's thread (inside the pool's upstream call) the
        lock is held already: the stream is recorded without waiting for it."""
        cdef size_t i
        cdef bint held = self._st.lock_thread == current_thread()
        s = use_key(s)
        if not held:
            self.lock()
        if holder == NULL or b.holder == holder:
            if b.extra_streams == NULL:
                b.extra_streams = new vector[StreamKey]()
            for i in range(b.extra_streams.size()):
                if same_stream(b.extra_streams[0][i], s):
                    break
            else:
                b.extra_streams.push_back(s)
        if not held:
            self.unlock()

    # Regions ----------------------------------------------------------------------------

    cdef void region_register(self, RegionCache* rc, bint lane) noexcept nogil:
        """A new region's cache rc joins the pool; lane: a thread-scope planned region's,
        which gets a lane (core/lane.pxd) unless GPUPOOL_LANES=0."""
        self.lock()
        rc.pool = <void*>self
        self._st.regions.push_back(rc)
        if lane and LANES:
            rc.lane = new Lane()
            self._st.lanes.push_back(rc)
            rc.lane.mutex.lock()        # held with the others until the unlock (ps_unlock)
        self.unlock()

    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil:
        """Make rc the region of every thread (enter) or stop; False if another one is."""
        cdef bint ok = True
        self.lock()
        if enter:
            ok = self._st.process_region == NULL
            if ok:
                self._st.process_region = rc
        elif self._st.process_region == rc:
            self._st.process_region = NULL
        self.unlock()
        return ok

    cdef void region_unregister(self, RegionCache* rc) noexcept nogil:
        """Forget a region and delete its cache rc (core/free.pxd, ps_drop_region): its live
        blocks return to the pool when freed, its cached ones now. On the lock's thread (a
        collection inside the pool's upstream call) that waits for the unlock."""
        if self._st.lock_thread == current_thread():
            self._st.dropped.push_back(rc)
            return
        self.lock()
        ps_drop_region(&self._st, rc)
        self.unlock()

    cdef void region_enter(self, RegionCache* rc, bint entry) noexcept nogil:
        """rc is entered on one more thread; entry: a new entry (its blocks used from now on
        are stamped with it), which may be a turn of regions of several threads (a planned
        one among them is then shared: core/turns.pxd)."""
        self.lock()
        rc.entered += 1
        if entry:
            rc.entries += 1
            rt_entered(&self._st, rc, current_thread())
            rc.shared_entries += rc.shared
        self.unlock()

    cdef void region_leave(self, RegionCache* rc) noexcept nogil:
        """rc is entered on one thread fewer; once on none, its cached blocks that the entry
        did not use go back to the pool."""
        self.lock()
        rc.entered -= 1
        if rc.entered == 0:
            pk_flush(&self._st)
            sg_return_unused(&self._st, rc)
        self.unlock()

    cdef void region_drain(self, RegionCache* rc) noexcept nogil:
        """Every cached block of a region goes back to the pool."""
        self.lock()
        sg_drain(&self._st, rc)
        self.unlock()

    # The interface of the layers above (core/pool.pxd lists it) -------------------------

    cdef size_t region_exit(self, RegionCache* rc, set kept, bint detach, int poison,
                            list escaping) except? 0:
        """The exit of region rc, under the pool's lock: its live blocks that escaped an
        earlier exit stay escaped; those in kept (block addresses) leave the region; with
        detach, or without a buffer, they escape (pointers appended to escaping); the others'
        buffers are invalidated and their blocks freed, on the buffer's stream, or, with
        poison >= 0, filled with that byte on the legacy stream once the device is idle (so
        the block now belongs to that stream; its bytes are read first: a freed block may
        join a neighbour). Returns the bytes of the region's live blocks at exit."""
        cdef int status = 0
        cdef size_t escaped
        self.lock()
        escaped = rg_exit(&self._st, self.upstream, rc, kept, detach, poison, escaping, &status)
        self.unlock()
        self.upstream.raise_error(status, "poisoning invalidated blocks")
        return escaped

    cdef uintptr_t region_plan(self, RegionCache* rc, PlanCall op, PlanTable* io) noexcept nogil:
        """A planned region's call on its table, under the lock (core/planned.pxd, pl_call)."""
        cdef uintptr_t r
        self.lock()
        r = pl_call(&self._st, rc, op, io)
        self.unlock()
        return r

    cdef Block* region_find_live(self, RegionCache* rc, uintptr_t ptr) noexcept nogil:
        """The live block of region rc holding ptr; NULL if none."""
        cdef Block* b
        self.lock()
        b = rc_find_live(rc, ptr)
        self.unlock()
        return b

    cdef RegionCache region_counters(self, RegionCache* rc) noexcept nogil:
        """A copy of region rc's record, read under the pool's lock (its counts)."""
        cdef RegionCache copy
        self.lock()
        copy = rc[0]
        self.unlock()
        return copy

    cdef void region_reset_peak(self, RegionCache* rc) noexcept nogil:
        """Region rc's peak bytes in use become the bytes its live buffers hold now."""
        self.lock()
        rc.peak_in_use_bytes = rc.live_bytes
        self.unlock()

    cdef int acquire_handed(self, size_t nbytes, StreamKey s, Block** out,
                            int way) noexcept nogil:
        """acquire, for a block handed out by pointer (the C API: a free finds it in the
        pool's table), through the shared path (the caller tried the magazine). Returns 0 or
        a status code (way: a PlanWay, as ps_acquire_locked's)."""
        cdef int r
        if self._st.lock_thread == current_thread():
            return GP_REENTRANT                 # from inside the pool's own upstream call
        self.lock()
        r = self.acquire_locked(nbytes, s, out, way)
        if r == 0:
            pt_insert(&self._st.capi_blocks, out[0].ptr, out[0])
            if hist_on(RECORDING):
                hist_alloc(self.device, self._st.segments.pool_id, out[0].ptr, nbytes, s.handle)
        self.unlock()
        return r

    cdef Block* _handed_locked(self, uintptr_t ptr, bint remove) noexcept nogil:
        return hd_find(&self._st, ptr, remove)

    cdef Block* take_handed(self, uintptr_t ptr) noexcept nogil:
        """The live block at ptr handed out by pointer, taken off the lists for its free
        (from inside the pool's upstream call the lock is the calling thread's already);
        NULL if none."""
        cdef Block* b
        if self._st.lock_thread == current_thread():
            return self._handed_locked(ptr, True)
        self.lock()
        b = self._handed_locked(ptr, True)
        self.unlock()
        return b

    cdef Block* find_handed(self, uintptr_t ptr) noexcept nogil:
        """The live block at ptr handed out by pointer; NULL if none."""
        cdef Block* b
        self.lock()
        b = self._handed_locked(ptr, False)
        self.unlock()
        return b

    cdef bint handed_segment(self, uintptr_t ptr, uintptr_t* base, size_t* nbytes) noexcept nogil:
        """The segment (base, bytes) of the live block at ptr handed out by pointer; whether
        there is one."""
        cdef Block* b
        self.lock()
        b = self._handed_locked(ptr, False)
        if b != NULL:
            base[0] = b.segment.base
            nbytes[0] = b.segment.nbytes
        self.unlock()
        return b != NULL

    cdef void note_oom(self, size_t nbytes, uintptr_t stream) noexcept nogil:
        """A request of nbytes on stream failed after the ladder: recorded while the memory
        history records."""
        self.lock()
        if RECORDING:
            hist_oom(self.device, self._st.segments.pool_id, nbytes, oom_headroom(&self._st),
                     stream)
        self.unlock()

    cdef int trim_all(self, size_t* released) noexcept nogil:
        """Give the pool's cached memory back, then the upstream's own (a status code: the
        upstream's trim, its error cleared); the bytes the pool gave back go to released."""
        cdef int r
        self.lock()
        released[0] = ld_trim(&self._st, self.upstream, NULL)
        r = self.upstream.trim()
        if r != 0:
            self.upstream.clear_error()
        self.unlock()
        return r

    cdef void cache_info(self, size_t* largest, size_t* headroom) noexcept nogil:
        """The largest free block any request may take (the pool's and idle regions', and
        threads' held blocks: served under pressure), and the bytes left under the hard
        limit (SIZE_MAX: none)."""
        self.lock()
        hd_cache_info(&self._st, self.thread_magazine(False), largest, headroom)
        self.unlock()

    cdef str oom_failure(self, size_t nbytes):
        """Count a failed request of nbytes for lack of memory (num_ooms) and return its
        OutOfMemoryError's message (for adapters that raise their own type with it)."""
        self.lock()
        self._st.counters.num_ooms += 1
        self.unlock()
        return str(self._oom_error(nbytes))

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
        return self.allocate_on(nbytes, self.check_stream(handle))

    cdef object allocate_on(self, object nbytes, StreamKey key):
        """``allocate`` once the stream is resolved to its key: checks ``nbytes``, takes the
        block (the calling thread's current region first), runs the ``on_oom`` callbacks
        and retries once, raises as ``allocate`` does, and wraps the block in a
        DeviceBuffer. The C-level entry of the adapters that build their own wrappers."""
        cdef size_t n
        cdef Block* b = NULL
        cdef int r, way = PW_SLOW_PATH
        if type(nbytes) is int and 0 < <object>nbytes <= MAX_NBYTES:
            n = nbytes
        else:
            n = check_nbytes(nbytes)
            if n == 0:
                return new_buffer(self, NULL, 0, key)
        while True:             # one call of acquire, which the compiler then inlines
            r = self.acquire(n, key, &b, way)
            if way == PW_ONLINE:
                hist_log(LOG_CALLBACK_RETRY, self.device, n, 0, r)
                break
            if r != CUDA_ERROR_OUT_OF_MEMORY or not run_oom_callbacks(self, n):
                break
            way = PW_ONLINE     # retried once, online (Note [Planned out-of-memory retry])
        if r != 0:
            self.raise_status(r, n)
        buf = new_buffer(self, b, n, key)
        rc_slow_path(b)
        return buf


gp_magazine_exit_hook = fp_thread_exit


cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1:
    """Run the on_oom callbacks for a request of nbytes (core/oom.pyx); whether there were
    any."""
    return oom_run_callbacks(&pool._st.counters, pool.device, nbytes)


include "snapshot.pxi"
