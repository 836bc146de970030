# The pool: one device's caching allocator. It keeps the lock, acquire and free of blocks
# and the out-of-memory ladder's errors; its state, construction and upkeep API are PoolBase's
# (core/poolbase.pxd); the layers it is made of are in
# core/freelist.pxd (free lists), core/streamorder.pxd (stream-ordered reuse), core/segments.pxd
# (segments: growth, cutting, joining, trimming) and core/regioncache.pxd (regions' blocks).
cimport cython
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.core.magazine cimport Magazine
from gpupool.core.regioncache cimport RegionCache
from gpupool.core.plantable cimport PlanTable, PlanCall
from gpupool.core.poolbase cimport PoolBase
from gpupool.records.streams cimport StreamKey

@cython.final
cdef class Pool(PoolBase):      # final: its cdef methods are direct calls the compiler inlines

    cdef void lock(self) noexcept nogil
    cdef void unlock(self) noexcept nogil
    cdef int acquire(self, size_t nbytes, StreamKey stream, Block** out, int way) noexcept nogil
    cdef int acquire_locked(self, size_t nbytes, StreamKey stream, Block** out,
                            int way) noexcept nogil
    cdef void free_locked(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void region_register(self, RegionCache* rc, bint lane) noexcept nogil
    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil
    cdef void region_unregister(self, RegionCache* rc) noexcept nogil
    cdef void region_enter(self, RegionCache* rc, bint entry) noexcept nogil
    cdef void region_leave(self, RegionCache* rc) noexcept nogil
    cdef void region_drain(self, RegionCache* rc) noexcept nogil
    cdef object raise_status(self, int status, size_t nbytes)
    cdef object _oom_error(self, size_t nbytes)
    cdef object allocate_on(self, object nbytes, StreamKey stream)

    # The interface of the layers above: what region/, ipc/, c_api/ and adapters/ may call.
    # NOTE: each of these takes the pool's lock itself (never call one holding it), but
    # take_handed (a free from inside the pool's upstream call, whose lock the calling thread
    # holds) and the mag_* fast path (no pool lock). No module outside the pool reads its
    # fields (_st) or calls lock()/unlock().
    cdef size_t region_exit(self, RegionCache* rc, set kept, bint detach, int poison,
                            list escaping) except? 0
    cdef uintptr_t region_plan(self, RegionCache* rc, PlanCall op, PlanTable* io) noexcept nogil
    cdef Block* region_find_live(self, RegionCache* rc, uintptr_t ptr) noexcept nogil
    cdef RegionCache region_counters(self, RegionCache* rc) noexcept nogil
    cdef void region_reset_peak(self, RegionCache* rc) noexcept nogil
    cdef int acquire_handed(self, size_t nbytes, StreamKey s, Block** out, int way) noexcept nogil
    cdef Block* _handed_locked(self, uintptr_t ptr, bint remove) noexcept nogil
    cdef Block* take_handed(self, uintptr_t ptr) noexcept nogil
    cdef Block* find_handed(self, uintptr_t ptr) noexcept nogil
    cdef bint handed_segment(self, uintptr_t ptr, uintptr_t* base, size_t* nbytes) noexcept nogil
    cdef void note_oom(self, size_t nbytes, uintptr_t stream) noexcept nogil
    cdef int trim_all(self, size_t* released) noexcept nogil
    cdef void cache_info(self, size_t* largest, size_t* headroom) noexcept nogil
    cdef str oom_failure(self, size_t nbytes)
    # (and PoolBase's: read_counters, reset_peaks, private_*, find_live, holder_at)

    # Magazines (core/magazine.pxd).
    cdef Magazine* thread_magazine(self, bint make) noexcept nogil
    cdef Block* fast_take(self, size_t nbytes, StreamKey s, int way) noexcept nogil
    cdef Block* mag_take(self, size_t nbytes, StreamKey s, bint capi) noexcept nogil
    cdef bint mag_put(self, Block* b, StreamKey s) noexcept nogil
    cdef bint mag_free_handed(self, uintptr_t ptr, StreamKey s, bint* done) noexcept nogil

cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1
# The error of a request made with the calling thread's tag asleep (core/tagging.pxi).
cdef object asleep_here()

# The calling thread's stack of entered regions (and uncached() markers), innermost last
# (core/regionstack.pxi, compiled into this module).
cdef int region_push(RegionCache* rc) except -1
cdef bint region_try_push(RegionCache* rc) noexcept nogil
cdef void region_pop(RegionCache* rc) noexcept nogil
cdef RegionCache* uncached_marker() noexcept nogil
