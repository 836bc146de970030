# The pool: one device's caching allocator. It keeps the lock, acquire and release of blocks,
# the out-of-memory ladder, the limits and the Python API; the layers it is made of are in
# core/freelist.pxd (free lists), core/streamorder.pxd (stream-ordered reuse), core/segments.pxd
# (segments: growth, cutting, joining, trimming) and core/regioncache.pxd (regions' blocks).
cimport cython
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.buffer.owner cimport BlockOwner
from gpupool.records.counters cimport Counters
from gpupool.core.freelist cimport FreeLists
from gpupool.core.magazine cimport Magazine, gp_lock
from gpupool.history.ring cimport LogKind
from gpupool.records.ptrtable cimport PtrTable
from gpupool.core.regioncache cimport RegionCache
from gpupool.core.segments cimport Segments
from gpupool.core.streamorder cimport StreamOrder
from gpupool.records.streams cimport StreamKey

cdef enum:
    WANTED_FAST = 64            # wanted streams the fast path tells exactly (more: the mask)
    PARK_SLOTS = 8              # freed blocks held aside for a request of their exact size

cdef enum:                      # the pool's sweeps over every magazine, counted (_sweeps)
    SWEEP_OTHERS = 0            # _mag_flush_others: a request's miss looks at idle threads'
    SWEEP_WANT                  # _mag_want: before the pool grows
    SWEEP_HANDED                # mag_find_handed_locked: a C API free not found in its table
    SWEEP_SETTLE                # _settle_peak: the bound passed the peak
    SWEEPS


@cython.final
cdef class Pool(BlockOwner):     # final: its cdef methods are direct calls the compiler inlines
    cdef gp_lock _mutex                 # an atomic word: one compare-and-swap when free
    cdef uintptr_t _holder              # thread holding _mutex, 0 when free
    cdef vector[Block*] _deferred       # frees made by _holder while it held the lock
    cdef FreeLists _free
    cdef StreamOrder _order
    cdef Segments _segments
    cdef Block* _parked[PARK_SLOTS]     # the blocks freed last, oldest first (PARKED)
    cdef int _nparked
    cdef vector[RegionCache*] _regions  # caches of this pool's regions, for the ladder
    cdef PtrTable capi_blocks           # blocks handed out by the C API, by pointer
    cdef Counters counters              # a magazine's blocks count as in use (core/magazine.pxd)
    cdef vector[Magazine*] _magazines   # every thread's magazine for this pool
    cdef size_t _bound                  # bytes in use plus every magazine's credit
    # What every thread's fast path (the magazines) reads, on cache lines of their own, off
    # those the shared path writes (the bound, the counters): a locked request does not take
    # them from the other threads' caches.
    cdef char _pad_hot[64]
    cdef RegionCache* _process_region   # entered with scope="process": covers every thread
    # The wanted streams (core/streamorder.pxd) as the fast path reads them, without the lock
    # (copied at each unlock): their threads take the shared path, which answers them. The
    # mask has each one's bit (wanted_bit): a stream whose bit is clear is not wanted, at
    # one load; one whose bit is set is looked for in the list.
    cdef unsigned long long _wanted_mask
    cdef int _nwanted                   # WANTED_FAST + 1: more than WANTED_FAST (the mask)
    cdef StreamKey _wanted[WANTED_FAST]
    cdef char _pad_cold[64]
    cdef size_t _soft_limit             # 0: none
    cdef size_t _sweeps[SWEEPS]         # diagnostics (Pool._sweep_counts), under the lock
    cdef object __weakref__

    cdef void lock(self) noexcept nogil
    cdef void _copy_wanted(self) noexcept nogil
    cdef void _wait(self) noexcept nogil
    cdef void unlock(self) noexcept nogil
    cdef int acquire(self, size_t nbytes, StreamKey stream, Block** out) noexcept nogil
    cdef int acquire_locked(self, size_t nbytes, StreamKey stream, Block** out) noexcept nogil
    cdef int _ladder(self, size_t size, StreamKey s, void* owner) noexcept nogil
    cdef int _grow_once(self, size_t size, StreamKey s, void* owner) noexcept nogil
    cdef Block* _unpark(self, size_t size, StreamKey s, RegionCache* rc) noexcept nogil
    cdef void _park(self, Block* b) noexcept nogil
    cdef void _put(self, Block* b) noexcept nogil
    cdef void flush_parked(self) noexcept nogil
    cdef void release_locked(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void region_register(self, RegionCache* rc) noexcept nogil
    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil
    cdef void region_unregister(self, RegionCache* rc) noexcept nogil
    cdef void region_enter(self, RegionCache* rc, bint entry) noexcept nogil
    cdef void region_leave(self, RegionCache* rc) noexcept nogil
    cdef void region_drain(self, RegionCache* rc) noexcept nogil
    cdef size_t trim_locked(self) noexcept nogil
    cdef void trim_logged(self, LogKind kind, size_t bound) noexcept nogil
    cdef int merge_streams_locked(self, size_t* moved) noexcept nogil
    cdef object raise_status(self, int status, size_t nbytes)
    cdef object _oom_error(self, size_t nbytes)
    cdef size_t _oom_free_bytes(self) noexcept nogil
    cdef object allocate_key(self, object nbytes, StreamKey stream)

    # Magazines (core/magazine.pxd).
    cdef Magazine* thread_magazine(self, bint make) noexcept nogil
    cdef Block* mag_take(self, size_t nbytes, StreamKey s, bint capi) noexcept nogil
    cdef bint mag_put(self, Block* b, StreamKey s) noexcept nogil
    cdef bint mag_free_handed(self, uintptr_t ptr, StreamKey s, bint* done) noexcept nogil
    cdef Block* mag_find_handed_locked(self, uintptr_t ptr, bint remove) noexcept nogil
    cdef void _deferred_magazine(self, Magazine* m) noexcept nogil
    cdef bint _mag_wait(self, Magazine* m, size_t* waits) noexcept nogil
    cdef bint _is_wanted_fast(self, StreamKey s) noexcept nogil
    cdef Block* _mag_take_locked(self, size_t size, StreamKey s) noexcept nogil
    cdef void _mag_hold(self, Magazine* m, Block* b, StreamKey s) noexcept nogil
    cdef void _mag_drop(self, Magazine* m, int i) noexcept nogil
    cdef void _mag_fold(self, Magazine* m) noexcept nogil
    cdef void _mag_flush(self, Magazine* m) noexcept nogil
    cdef bint _mag_flush_own(self, size_t size, bint growing) noexcept nogil
    cdef bint mag_flush_mine(self) noexcept nogil
    cdef bint _mag_flush_others(self, StreamKey s) noexcept nogil
    cdef bint _mag_drop_stream(self, Magazine* m, StreamKey s) noexcept nogil
    cdef bint _mag_reap(self) noexcept nogil
    cdef bint _mag_sweep(self, bint exited_only) noexcept nogil
    cdef void _mag_want(self, size_t size, StreamKey s) noexcept nogil
    cdef void _mag_give_up(self, StreamKey s) noexcept nogil
    cdef bint mag_flush_all(self) noexcept nogil
    cdef void count_taken(self, size_t size) noexcept nogil
    cdef void reset_peaks_locked(self) noexcept nogil
    cdef size_t largest_held(self) noexcept nogil
    cdef void _settle_peak(self) noexcept nogil
    cdef size_t _take_credit(self, Magazine* m, size_t most, size_t excess) noexcept nogil
    cdef size_t _freeze(self) noexcept nogil
    cdef void _thaw(self) noexcept nogil
    cdef Counters counters_view(self) noexcept nogil

cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1

# The calling thread's stack of entered regions (and uncached() markers), innermost last
# (core/regionstack.pxi, compiled into this module).
cdef int region_push(RegionCache* rc) except -1
cdef bint region_try_push(RegionCache* rc) noexcept nogil
cdef void region_pop(RegionCache* rc) noexcept nogil
cdef RegionCache* uncached_marker() noexcept nogil
