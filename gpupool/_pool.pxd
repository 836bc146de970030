# The pool: size classes, free lists binned by (size class, stream), stream-ordered reuse,
# slabs, limits and the first rungs of the out-of-memory ladder. C-level, under one mutex.
cimport cython
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool._block cimport Block, Slab, StreamKey, FreeLists, RegionCache, PtrTable
from gpupool._upstream cimport Upstream

cdef extern from "gp_lock.h" nogil:
    cppclass gp_lock:           # an atomic word: one compare-and-swap when free, then a futex
        void lock()
        bint try_lock()
        void unlock()

cdef struct Counters:
    size_t in_use
    size_t peak_in_use
    size_t reserved
    size_t peak_reserved
    size_t cached
    size_t num_allocs
    size_t num_frees
    size_t cache_hits
    size_t cache_misses
    size_t upstream_allocs
    size_t upstream_frees
    size_t oom_retries
    size_t num_ooms
    size_t allocated_bytes      # cumulative, as PyTorch's allocated_bytes.all.allocated
    size_t freed_bytes

cdef enum:
    GP_REENTRANT = 100002     # the pool was entered again by the thread holding its lock
    GP_FORKED = 100003        # the pool was inherited through fork()

ctypedef object (*buffer_factory)(Pool pool, Block* blk, size_t nbytes, StreamKey stream)


@cython.final
cdef class Pool:     # final: its cdef methods are direct calls the compiler can inline
    cdef gp_lock _mutex
    cdef uintptr_t _owner               # thread holding _mutex, 0 when free
    cdef vector[Block*] _deferred       # frees made by _owner while it held the lock
    cdef readonly Upstream upstream
    cdef readonly int device
    cdef FreeLists _free
    cdef vector[uintptr_t] _events      # recycled events
    cdef vector[RegionCache*] _regions  # caches of this pool's regions, for the OOM ladder
    cdef Slab* _slab                    # the slab small blocks are carved from now
    cdef RegionCache* _process_region   # entered with scope="process": covers every thread
    cdef vector[StreamKey] _wanted      # streams whose free blocks another stream waits for
    cdef PtrTable _capi_blocks          # blocks handed out by the C API, by pointer
    cdef Counters c
    cdef uintptr_t _ranks               # blocks created so far
    cdef size_t _hard_limit             # 0: none
    cdef size_t _soft_limit             # 0: none
    cdef object __weakref__

    cdef void lock(self) noexcept nogil
    cdef void _wait(self) noexcept nogil
    cdef StreamKey created_stream_key(self, uintptr_t handle) noexcept nogil
    cdef int stream_status(self, uintptr_t handle) noexcept nogil
    cdef StreamKey checked_key(self, uintptr_t handle) except *
    cdef RegionCache* _current_region(self) noexcept nogil
    cdef uintptr_t _event(self) noexcept nogil
    cdef void _drop_events(self, Block* b) noexcept nogil
    cdef bint _after(self, uintptr_t event, StreamKey s, bint wait) noexcept nogil
    cdef bint _ready(self, Block* b, StreamKey s, bint wait) noexcept nogil
    cdef Block* _take(self, FreeLists* fl, int cls, StreamKey s) noexcept nogil
    cdef Block* _take_larger(self, int cls, StreamKey s) noexcept nogil
    cdef Block* _take_split(self, int cls, size_t size, StreamKey s) noexcept nogil
    cdef void _split(self, Block* b, int cls, size_t size, StreamKey s) noexcept nogil
    cdef bint _joinable(self, Block* a, Block* b) noexcept nogil
    cdef void _unbin(self, Block* b) noexcept nogil
    cdef void _join(self, Block* a, Block* b) noexcept nogil
    cdef void _push_pool(self, Block* b) noexcept nogil
    cdef int _upstream_alloc(self, size_t nbytes, StreamKey s, uintptr_t* ptr) noexcept nogil
    cdef int _carve(self, int cls, size_t size, StreamKey s, Block** out) noexcept nogil
    cdef int _slab_event(self, Slab* slab) noexcept nogil
    cdef void _mark_stream(self, StreamKey s) noexcept nogil
    cdef void _answer_wanted(self, StreamKey s) noexcept nogil
    cdef void _upstream_free(self, uintptr_t ptr, size_t nbytes) noexcept nogil
    cdef void _mark_blocks(self, FreeLists* fl, StreamKey s) noexcept nogil
    cdef int _new_block(self, int cls, size_t size, StreamKey s, Block** out) noexcept nogil
    cdef size_t _segment_bytes(self) noexcept nogil
    cdef int _grow(self, size_t nbytes, int cls, size_t size, StreamKey s, bint pack,
                   Block** out) noexcept nogil
    cdef int _exact_block(self, size_t nbytes, StreamKey s, Block** out) noexcept nogil
    cdef void unlock(self) noexcept nogil
    cdef int acquire(self, size_t nbytes, StreamKey stream, Block** out) noexcept nogil
    cdef int acquire_locked(self, size_t nbytes, StreamKey stream, Block** out) noexcept nogil
    cdef void release(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void release_locked(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void add_stream(self, Block* blk, StreamKey stream) noexcept nogil
    cdef void region_register(self, RegionCache* rc) noexcept nogil
    cdef bint region_set_process(self, RegionCache* rc, bint enter) noexcept nogil
    cdef void region_unregister(self, RegionCache* rc) noexcept nogil
    cdef void region_drain(self, RegionCache* rc) noexcept nogil
    cdef void region_detach(self, Block* blk) noexcept nogil
    cdef void region_escape(self, Block* blk) noexcept nogil
    cdef size_t release_cached(self) noexcept nogil
    cdef void _join_pieces(self, vector[Block*]* pieces, vector[Block*]* keep,
                           vector[Block*]* whole) noexcept nogil
    cdef void _rebin_unused(self, FreeLists* fl, vector[Block*]* blocks,
                            size_t* moved) noexcept nogil
    cdef void _merge_free_lists(self, FreeLists* fl, size_t* moved) noexcept nogil
    cdef int merge_streams_locked(self, size_t* moved) noexcept nogil
    cdef object raise_status(self, int status, size_t nbytes)
    cdef object allocate_key(self, object nbytes, StreamKey stream)

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()


cdef inline uintptr_t _thread() noexcept nogil:
    return <uintptr_t>pthread_self()


cdef inline StreamKey stream_key(uintptr_t handle) noexcept nogil:
    """A stream's key from its handle alone: the legacy stream (0, or CU_STREAM_LEGACY = 1)
    is 0; the per-thread stream (CU_STREAM_PER_THREAD = 2) is tagged with the thread."""
    if handle <= 1:
        return StreamKey(0, 0)
    return StreamKey(handle, _thread() if handle == 2 else 0)


# The tag of a created stream's key when the driver refused the handle (no stream ID is this).
cdef enum:
    BAD_STREAM_TAG = 0xFFFFFFFFFFFFFFFF


cdef inline StreamKey pool_key(Pool pool, uintptr_t handle) noexcept nogil:
    """The key of the stream with this handle, as the calling thread names it; no call for
    the default streams (the hot path)."""
    if handle <= 2:
        return stream_key(handle)
    return pool.created_stream_key(handle)
cdef bint run_oom_callbacks(Pool pool, size_t nbytes) except -1
cdef uintptr_t stream_handle(object stream) except? 0xFFFFFFFFFFFFFFFF
cdef void set_buffer_factory(buffer_factory factory) noexcept
cdef int region_push(RegionCache* rc) except -1
cdef void region_pop(RegionCache* rc) noexcept nogil
cdef RegionCache* uncached_marker() noexcept nogil
cdef bint forked() noexcept nogil
