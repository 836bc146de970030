# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""What a pool is before it serves a request: its state (core/state.pxd) and upstream, made
from the ``Pool`` arguments and given back at its end, and the Python API that reads or
maintains that state (statistics, the consistency check, ``trim``, ``merge_streams``, the
limits). ``Pool`` (core/pool.pyx) adds the requests and frees and the operations the layers
above call."""
from cpython.ref cimport PyObject
from libcpp.vector cimport vector
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, Segment, HostChunk, LIVE
from gpupool.driver.calls cimport fork_flag
from gpupool.core.freelist cimport fl_each
from gpupool.core.magpool cimport mp_reap, mp_flush_all, mp_counters_view, mp_reset_peaks
from gpupool.core.parking cimport pk_flush
from gpupool.core.handed cimport hd_private_live
from gpupool.core.private cimport pp_allocate_at, pp_end
from gpupool.core.regioncache cimport RegionCache
from gpupool.records.counters cimport Counters
from gpupool.records.streams cimport StreamKey, current_thread
from gpupool.core.segments cimport BLOCK_ALIGN, round_request, sg_find_live
from gpupool.records.sizes cimport check_nbytes
from gpupool.core.ladder cimport ld_trim, ld_merge_streams
from gpupool.core.giveback cimport Refused, sg_release_all, sg_refused_text
from gpupool.core.verify cimport ps_verify, ps_verify_chunks, ps_magazines_info, ps_sweep_counts
from gpupool.core.fastpath cimport fp_detach
from gpupool.core.lock cimport ps_lock
from gpupool.core.free cimport ps_unlock
from gpupool.history.ring cimport register_pool, hist_flush_log
from gpupool.core.oom cimport oom_note_total
from gpupool.core.growexpand cimport sg_map
from gpupool.core.segments cimport sg_note
from gpupool.core.tagged cimport tg_segment, tg_sleep_counts
from gpupool.history.ring cimport ACT_SEGMENT_UNMAP
from gpupool.core.offload cimport of_copy_out, of_keep, of_free
from gpupool.upstream.base cimport Upstream, HOST_TO_DEVICE
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY

import logging
import warnings

import numpy as np

from gpupool.core.upstreams import make_upstream
from gpupool.driver.ordinals import check_ordinal
from gpupool.core.tags import tag_ids, tag_name
from gpupool.errors import (
    FORK_MESSAGE, REENTRANT_MESSAGE, GpupoolError, OutOfMemoryError, not_picklable,
    unexpected_keyword,
)
from gpupool.limits import resolve_limits
from gpupool.stats import PoolStats, torch_memory_stats
from gpupool.upstream.python import PythonUpstream

cdef extern from "Python.h" nogil:
    Py_ssize_t Py_REFCNT(PyObject* o)

cdef const int* FORKED = fork_flag()
_logger = logging.getLogger("gpupool")


def size_class(nbytes):
    """Bytes a request of ``nbytes`` takes from the pool: ``nbytes`` rounded up to a multiple
    of 512 (at most 511 B more); 0 for 0.

    Parameters
    ----------
    nbytes : int
        Request in bytes, 0 <= nbytes <= 2**50.
    """
    return round_request(check_nbytes(nbytes))


cdef class PoolBase(BlockOwner):
    """A pool's state, construction and upkeep; see ``Pool`` for its arguments."""

    def __cinit__(self, device=0, upstream=None, hard_limit=None, soft_limit=None, **unknown):
        cdef size_t free = 0, total = 0
        if unknown:                             # (Python's own message names __cinit__)
            raise unexpected_keyword(type(self), next(iter(unknown)))
        self._offloaded = {}
        self.upstream = make_upstream(check_ordinal(device), upstream)
        self.device = self._st.segments.device = self.upstream.device
        # A hard limit holds at least one block (an exact request under it is never below
        # BLOCK_ALIGN, which the free lists' smallest class assumes) and, on an expandable
        # upstream, one page: the pool reserves no less.
        expandable = self.upstream.expandable
        self._st.segments.hard_limit, self._st.soft_limit = resolve_limits(
            hard_limit, soft_limit, lambda: self.mem_info()[1],
            self.upstream.granularity if expandable else BLOCK_ALIGN,
            "page" if expandable else "block")
        # A stream-ordered upstream keeps freed memory up to the soft limit for regrowth.
        self.upstream.raise_error(self.upstream.set_release_threshold(self._st.soft_limit),
                                  "set_release_threshold")
        self._st.segments.pool_id = register_pool(self)
        # The device's total, for an out-of-memory error that makes no driver call itself
        # (core/oom.pyx): asked once here of a driver upstream, failure ignored; a Python
        # upstream is not called (a test counts its calls) but may declare it (total_bytes,
        # the simulated device's capacity), else it is learnt when mem_info() is called.
        if not isinstance(self.upstream, PythonUpstream):
            if self.upstream.mem_info(&free, &total) == 0:
                oom_note_total(self._st.segments.pool_id, total)
            else:
                self.upstream.clear_error()
        elif getattr(self.upstream, "total_bytes", None):
            oom_note_total(self._st.segments.pool_id, self.upstream.total_bytes)

    def __dealloc__(self):
        # Buffers and regions hold references to their pool, so only free lists remain.
        cdef size_t i
        cdef Segment* seg
        if FORKED[0]:
            return
        # Threads' magazines let go of the pool whatever else happens (the garbage collector
        # may have cleared upstream already): a thread must never take a dead pool's
        # magazine for a new pool at the same address.
        for i in range(self._st.magazines.size()):
            fp_detach(self._st.magazines[i])
        self._st.magazines.clear()
        if self.upstream is None:
            return
        self._st.mutex.lock()
        if self._st.segments.head != NULL and (self.upstream.expandable
                                            or self.upstream.stream_ordered):
            # Queued work may still use freed blocks: unmapping pages (cuMemUnmap) does not
            # wait for it as cuMemFree does, nor does a stream-ordered free wait for other
            # streams' work. (A failure: the context is gone, and its work with it.)
            if self.upstream.synchronize() != 0:
                self.upstream.clear_error()
        seg = self._st.segments.head
        while seg != NULL:                  # the host copies of sleeping tags
            of_free(self.upstream, &seg.offload, &self._st.counters)
            seg = seg.next
        sg_release_all(&self._st, self.upstream)
        of_free(self.upstream, &self._spare, &self._st.counters)
        for i in range(self._st.order.events.size()):
            self.upstream.event_destroy(self._st.order.events[i])
        self.upstream.clear_error()         # at the end nothing reports a failure
        self._st.mutex.unlock()

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
        self.lock_here()
        mp_flush_all(&self._st)
        pk_flush(&self._st)
        fl_each(&self._st.free, &blocks)
        found = [(blocks[i].ptr, blocks[i].size,
                  blocks[i].seg_prev != NULL or blocks[i].seg_next != NULL)
                 for i in range(blocks.size()) if blocks[i].region.cache == NULL]
        ps_unlock(&self._st, self.upstream)
        return sorted(found)

    def _verify(self):
        """Check the pool's bookkeeping: segments tiled by their blocks, the free lists and
        the parked blocks, region tags and their byte counts, the counters, and (where the
        upstream lists them) the chunks mapped for expandable segments. Returns the
        problems found (an empty list when all is consistent). For tests: it walks every
        block under the lock."""
        chunks = getattr(self.upstream, "_chunks", None)
        self.lock_here()
        try:
            problems = ps_verify(&self._st)
            if chunks is not None:
                problems += ps_verify_chunks(&self._st, chunks, self.upstream.granularity)
        finally:
            ps_unlock(&self._st, self.upstream)
        return problems

    def _magazines_info(self):
        """Every thread's magazine for this pool, for tests and diagnostics: a list of dicts
        (core/verify.pxd, ps_magazines_info, names the keys)."""
        self.lock_here()
        out = ps_magazines_info(&self._st)
        ps_unlock(&self._st, self.upstream)
        return out

    def _sweep_counts(self):
        """How often the pool's lock holder swept every magazine, for diagnostics: a dict of
        counts (core/verify.pxd, ps_sweep_counts, names the keys)."""
        self.lock_here()
        out = ps_sweep_counts(&self._st)
        ps_unlock(&self._st, self.upstream)
        return out

    def _counters(self):
        """The counters record as a dict (bytes and counts), read under the lock (and every
        thread's magazine's)."""
        self.lock_here()
        mp_reap(&self._st)                # exited threads' magazines: not read again and again
        c = mp_counters_view(&self._st)
        ps_unlock(&self._st, self.upstream)
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
        self.lock_here()
        mp_reset_peaks(&self._st)
        ps_unlock(&self._st, self.upstream)



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
        self.lock_here()
        r = ld_merge_streams(&self._st, self.upstream, &moved)
        ps_unlock(&self._st, self.upstream)
        self.upstream.raise_error(r, "synchronize")
        return moved

    def trim(self):
        """Give the pool's cached memory back to the upstream: every wholly free segment.

        Blocks cached by regions stay with their regions (``Region.release()`` returns them).
        Synchronizes the device first when a cached block may still be in use by queued work.
        On an expandable upstream every whole free page is unmapped, but a tag's (``sleep``
        unmaps those).

        Returns
        -------
        int
            Bytes released (also logged to the ``"gpupool"`` logger at DEBUG).

        Raises
        ------
        CudaError (or a Python upstream's own exception)
            The upstream's own trim failed (the ``async`` upstream's ``cuMemPoolTrimTo``).
        GpupoolError
            In a fork() child, or inside the pool's own upstream call.

        Warns
        -----
        RuntimeWarning
            The upstream refused a free or an unmap (``cuMemFree``, ``cuMemUnmap``) or the
            synchronize before them, naming its error and the bytes left. Not raised: a
            refused free frees nothing, so the memory stays cached and counted and a later
            trim tries again (Note [Failure injection]); the ladder's own trims say nothing.
        """
        cdef int r
        cdef Refused refused = Refused(0, 0, 0, NULL)
        self.lock_here()
        released = ld_trim(&self._st, self.upstream, &refused)
        # The refusal's error is taken before the upstream's trim can replace it.
        refusal = sg_refused_text(&self._st, self.upstream, &refused)
        r = self.upstream.trim()
        reserved = self._st.counters.reserved
        ps_unlock(&self._st, self.upstream)
        hist_flush_log()
        _logger.debug("gpupool: trim released %d B on device %d (%d B reserved now)",
                      released, self.device, reserved)
        if refusal:
            warnings.warn(refusal, RuntimeWarning)  # (at the caller: Cython makes no frame)
        self.upstream.raise_error(r, "trim")
        return released

    def sleep(self, tags, offload=False):
        """Give the physical memory of tagged blocks back, keeping their addresses.

        For each tag (``gpupool.tag``): the device is synchronized (``cuCtxSynchronize``:
        every stream's work on the tag's blocks is done; a stream being captured into a
        CUDA graph must not be), with ``offload`` the bytes of the tag's live blocks are
        copied to host memory, then every page of the tag's segment (live blocks and its
        free space) is unmapped and released; its range of address space stays reserved.
        Buffers keep their objects and pointers; reading, writing or exporting one raises
        ``SleepingMemoryError`` until ``wake``, and so does an allocation with the tag.
        Untagged memory and other tags' are untouched. A tag already asleep is skipped, and
        so is a tag with no memory, one never used included (a misspelt name too): nothing
        to do and no error, as vLLM's ``CuMemAllocator`` passes over tags that no allocation
        carries; ``stats().asleep_bytes`` counts what sleeps.

        Parameters
        ----------
        tags : str or iterable of str
            The tags to put to sleep.
        offload : bool
            Keep the live blocks' bytes (copied to host memory, restored by ``wake``); False
            discards them (activations, KV caches). A buffer closed while asleep leaves
            ``offloaded_bytes``; the host copy goes back once no offloaded buffer is left.

        Raises
        ------
        TypeError
            ``offload`` not a bool (NumPy's too), as ``Region``'s flags.
        GpupoolError
            The upstream is not expandable: sleep needs ``Pool(upstream="vmm")``.
        CudaError
            The synchronize, a copy or the unmap failed: the tag stays awake, its bytes kept.
        MemoryError
            No host memory for the offload (the tag stays awake).
        """
        if not isinstance(offload, (bool, np.bool_)):
            raise TypeError(f"offload must be a bool, got {offload!r}")
        ids = self._tag_targets(tags)
        for tid in ids:
            self._sleep_one(tid, offload)

    def wake(self, tags):
        """Map new physical memory for sleeping tags at the same addresses.

        For each sleeping tag: its segment's pages are mapped again (at the addresses
        they had), the bytes ``sleep(offload=True)`` kept are copied back, and the device is
        synchronized, so the memory is usable on any stream when this returns. Contents
        not offloaded are undefined (not zeroed). The whole segment is mapped, its free pages
        too. A tag that is awake, or never used, is skipped.

        Parameters
        ----------
        tags : str or iterable of str
            The tags to wake.

        Raises
        ------
        OutOfMemoryError, CudaError
            The pages could not be mapped (the tag stays asleep, its host bytes kept) or the
            copies failed (the tag is awake, its offloaded bytes lost).
        GpupoolError
            The upstream is not expandable.
        """
        for tid in self._tag_targets(tags):
            self._wake_one(tid)

    cdef bint block_asleep(self, Block* blk) noexcept nogil:
        """Whether live block blk's pages are unmapped (its tag sleeps); read without the
        lock: a buffer's check before its own copies and exports (sleep and wake must not
        race with the buffer's use, as any free must not)."""
        return blk.segment.asleep

    cdef int lock_here(self) except -1:
        """Take the pool's lock for a call from Python. Raises GpupoolError in a fork()
        child (a thread that did not fork may hold the lock there) and inside the pool's
        own upstream call (this thread holds it): waiting would never end."""
        self.check_usable()
        ps_lock(&self._st)
        return 0

    cdef int check_usable(self) except -1:
        """Raise GpupoolError where taking the pool's lock would never end (lock_here)."""
        if FORKED[0]:
            raise GpupoolError(FORK_MESSAGE)
        if self._st.lock_thread == current_thread():
            raise GpupoolError(REENTRANT_MESSAGE)
        return 0

    def _tag_targets(self, tags):
        if FORKED[0]:
            raise GpupoolError(FORK_MESSAGE)
        if not self.upstream.expandable:
            fix = ("make its simulated device with gpupool.testing.SimulatedDevice("
                   "virtual_memory=True)" if self.upstream.host_accessible else
                   "make the pool with gpupool.Pool(upstream='vmm')")
            raise GpupoolError(
                f"sleep and wake need an expandable upstream, whose pages can be unmapped at "
                f"fixed addresses: {fix} (this one's upstream is {self.upstream!r})")
        return tag_ids(tags)

    def _sleep_one(self, int tid, bint offload):
        cdef Segment* seg
        cdef Upstream up = self.upstream
        cdef HostChunk chunk = HostChunk(0, 0, False)
        cdef int r = 0
        cdef str what = "synchronize"
        copies = []
        self.lock_here()
        try:
            seg = tg_segment(&self._st.segments, tid)
            if seg == NULL or seg.asleep:
                return
            r = up.synchronize()
            if offload and r == 0:
                what = "copy to the host"
                r = of_copy_out(up, seg, &self._spare, &self._st.counters, &chunk, copies)
            if r == 0 and seg.nbytes:
                what = "unmap"
                r = up.unmap(seg.base, seg.nbytes)
            if r == 0:
                seg.offload = chunk             # the segment's now (tg_free may give it back)
                chunk = HostChunk(0, 0, False)
                tg_sleep_counts(&self._st, seg, True)
                seg.asleep = True
                sg_note(&self._st.segments, ACT_SEGMENT_UNMAP, seg.base, seg.nbytes, seg.stream)
                self._offloaded[tid] = copies
        finally:
            ps_unlock(&self._st, up)
        try:
            up.raise_error(r, f"sleep ({what})")
        finally:
            if r != 0:
                self.keep_host(&chunk)      # after the error is taken: it clears its own

    def _wake_one(self, int tid):
        cdef Segment* seg
        cdef Upstream up = self.upstream
        cdef uintptr_t ptr, host
        cdef size_t n
        cdef HostChunk chunk = HostChunk(0, 0, False)
        cdef int r = 0
        cdef str what = "map"
        self.lock_here()
        try:
            seg = tg_segment(&self._st.segments, tid)
            if seg == NULL or not seg.asleep:
                return
            if seg.nbytes:
                r = sg_map(&self._st, up, seg.base, seg.nbytes, seg.stream, True)
            if r == 0:
                seg.asleep = False
                tg_sleep_counts(&self._st, seg, False)
                chunk = seg.offload
                seg.offload = HostChunk(0, 0, False)
                copies = self._offloaded.pop(tid, ())
                what = "copy from the host"
                # No chunk: every offloaded block was freed while asleep (tg_free gave it
                # back); with one, runs with blocks freed since copy into free memory.
                for ptr, host, n in (copies if chunk.ptr else ()):
                    if r == 0:
                        r = up.copy(HOST_TO_DEVICE, ptr, host, n, 0)
                if r == 0:
                    what = "synchronize"
                    r = up.synchronize()
        finally:
            ps_unlock(&self._st, up)
        try:
            if r == CUDA_ERROR_OUT_OF_MEMORY and what == "map":
                raise OutOfMemoryError(
                    f"wake of tag {tag_name(tid)!r}: {seg.nbytes} B could not be mapped (out "
                    f"of memory, or over the hard limit); the tag stays asleep",
                    requested_bytes=seg.nbytes)
            up.raise_error(r, f"wake ({what})")
        finally:
            if what != "map":
                self.keep_host(&chunk)      # after the error is taken: it clears its own

    cdef int keep_host(self, HostChunk* chunk) except -1:
        """Take back the host memory of a wake or of a failed sleep (of_keep)."""
        self.lock_here()
        of_keep(self.upstream, &self._spare, &self._st.counters, chunk)
        ps_unlock(&self._st, self.upstream)
        return 0

    def release_pinned(self):
        """Give back the page-locked host memory kept for the next ``sleep(offload=True)``.

        An offloading sleep copies into one page-locked chunk (``cuMemHostAlloc``), which
        ``wake`` keeps for the next sleep (pinning gigabytes takes seconds; a chunk at least
        as large as the next sleep's live bytes is reused as is). That chunk goes back here
        and at the pool's end; the chunks of tags asleep now stay until their wake.
        ``PoolStats.pinned_bytes`` counts both.

        Returns
        -------
        int
            Bytes given back (``cuMemFreeHost``; a refusal leaves them with the driver).
        """
        self.lock_here()
        nbytes = self._spare.nbytes
        of_free(self.upstream, &self._spare, &self._st.counters)
        ps_unlock(&self._st, self.upstream)
        return nbytes

    def mem_info(self):
        """``(free, total)`` bytes of the device (``cuMemGetInfo``)."""
        cdef size_t f = 0, t = 0
        self.upstream.raise_error(self.upstream.mem_info(&f, &t), "cuMemGetInfo")
        oom_note_total(self._st.segments.pool_id, t)
        return f, t

    @property
    def hard_limit(self):
        """Bytes the pool never exceeds in reserved memory; None when unlimited."""
        return self._st.segments.hard_limit or None

    @property
    def soft_limit(self):
        """Reserved bytes above which cached blocks are released; None when unlimited."""
        return self._st.soft_limit or None

    def __reduce__(self):
        raise not_picklable(
            "a gpupool.Pool", "make the pool where it is used (gpupool.get_pool(), or "
            "gpupool.Pool(...) in the other process) and pickle buffers: they carry their bytes")

    def __repr__(self):
        try:
            c = self._counters()
        except GpupoolError:            # a fork() child, the pool's own upstream call
            return f"<gpupool.Pool device={self.device} (unusable here: its lock is held)>"
        return (f"<gpupool.Pool device={self.device} upstream={self.upstream!r} "
                f"in_use={c['in_use']} reserved={c['reserved']}>")

    # The interface of the layers above that reads the pool's state (core/poolbase.pxd) -----

    cdef Counters read_counters(self) noexcept nogil:
        """The counters (core/magpool.pxd, mp_counters_view), read under the lock."""
        cdef Counters c
        ps_lock(&self._st)
        c = mp_counters_view(&self._st)
        ps_unlock(&self._st, self.upstream)
        return c

    cdef void reset_peaks(self) noexcept nogil:
        ps_lock(&self._st)
        mp_reset_peaks(&self._st)
        ps_unlock(&self._st, self.upstream)

    cdef size_t private_live(self, RegionCache* rc, uintptr_t* ptrs, size_t* sizes,
                             size_t capacity) noexcept nogil:
        """The live blocks of private pool rc: the first capacity ones' pointers and sizes
        go to ptrs and sizes; returns how many there are."""
        cdef size_t n
        ps_lock(&self._st)
        n = hd_private_live(rc, ptrs, sizes, capacity)
        ps_unlock(&self._st, self.upstream)
        return n

    cdef bint private_allocate_at(self, RegionCache* rc, uintptr_t ptr, size_t nbytes,
                                  StreamKey s) noexcept nogil:
        """Make [ptr, ptr + nbytes) of private pool rc's free memory a live block used on s,
        handed out by pointer (core/private.pxd); whether it was free there."""
        cdef bint done
        ps_lock(&self._st)
        pk_flush(&self._st)
        done = pp_allocate_at(&self._st, rc, ptr, nbytes, s)
        ps_unlock(&self._st, self.upstream)
        return done

    cdef void private_end(self, RegionCache* rc) noexcept nogil:
        ps_lock(&self._st)
        pp_end(&self._st, rc)
        ps_unlock(&self._st, self.upstream)

    cdef Block* find_live(self, uintptr_t ptr, size_t nbytes) noexcept nogil:
        """The live block holding [ptr, ptr + nbytes); NULL if none."""
        cdef Block* b
        ps_lock(&self._st)
        b = sg_find_live(&self._st.segments, ptr, nbytes)
        ps_unlock(&self._st, self.upstream)
        return b

    cdef object holder_at(self, uintptr_t ptr, size_t nbytes, bint* found):
        """The DeviceBuffer holding the live block around [ptr, ptr + nbytes) (None for a
        block handed out by pointer, or none); found: whether there is such a block. With
        the GIL: a holder whose count is 0 is dying (its __dealloc__ waits for the lock held
        here), and no other thread changes counts meanwhile."""
        cdef Block* b
        holder = None
        ps_lock(&self._st)
        b = sg_find_live(&self._st.segments, ptr, nbytes)
        found[0] = b != NULL
        if b != NULL and b.holder != NULL and Py_REFCNT(<PyObject*>b.holder) > 0:
            holder = <object>b.holder
        ps_unlock(&self._st, self.upstream)
        return holder
