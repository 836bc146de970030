# The out-of-memory ladder's last step and its error: the on_oom callbacks (run by the caller,
# with the GIL, outside the pool's lock) and the OutOfMemoryError built from the pool's numbers
# (OomFacts: gathered under the lock by oom_gather, turned into the error without it).
from libc.stdint cimport uintptr_t, uint32_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, Segment, LIVE, UNMAPPED
from gpupool.records.counters cimport Counters
from gpupool.core.handed cimport hd_cache_info
from gpupool.core.magazine cimport Magazine
from gpupool.core.magpool cimport mp_counters_view
from gpupool.core.regioncache cimport RegionCache, rc_lends
from gpupool.core.state cimport PoolState
from gpupool.upstream.base cimport Upstream

cdef cppclass OomFacts:
    Counters c                  # mp_counters_view: a magazine's blocks count as cached
    size_t hard_limit           # 0: none
    size_t page                 # bytes of the expandable upstream's page; 0: a plain one
    size_t largest              # the largest free block any request may take
    size_t servable             # bytes of free blocks that alone could serve the request
    vector[uintptr_t] owners    # regions and private pools with live blocks (RegionCache*)
    vector[size_t] owner_bytes
    vector[int] owner_private   # 1: a private pool (RegionCache.held)
    vector[uintptr_t] streams   # streams with live blocks (handles), and their bytes
    vector[size_t] stream_bytes

cdef bint oom_run_callbacks(Counters* c, int device, size_t nbytes) except -1
cdef object oom_error(int device, uint32_t pool_id, bint real_device, OomFacts* f,
                      size_t nbytes)
cdef void oom_note_total(uint32_t pool_id, size_t total) noexcept


cdef inline size_t oom_headroom(PoolState* st) noexcept nogil:
    """What the pool may still reserve under its hard limit (0 without one), for the memory
    history's out-of-memory entry: as for the error, no driver call is made."""
    cdef size_t limit = st.segments.hard_limit, reserved = st.counters.reserved
    return limit - reserved if limit > reserved else 0


cdef inline void oom_gather(PoolState* st, Upstream up, Magazine* mine, size_t nbytes,
                            OomFacts* f) noexcept nogil:
    """Under the pool's lock: the facts of a failed request of nbytes from up (mine: the
    calling thread's magazine). One walk over the segments: O(blocks), paid only when
    raising."""
    cdef size_t headroom, i
    cdef Segment* seg = st.segments.head
    cdef Block* b
    cdef RegionCache* rc
    hd_cache_info(st, mine, &f.largest, &headroom)      # parked and mine flushed first
    f.c = mp_counters_view(st)
    f.hard_limit = st.segments.hard_limit
    f.page = up.granularity if up.expandable else 0
    f.servable = 0
    while seg != NULL:
        b = seg.first
        while b != NULL:
            if b.state == LIVE:
                for i in range(f.streams.size()):
                    if f.streams[i] == b.stream.handle:
                        f.stream_bytes[i] += b.size
                        break
                else:
                    f.streams.push_back(b.stream.handle)
                    f.stream_bytes.push_back(b.size)
            elif b.size >= nbytes and b.state != UNMAPPED:   # free, parked or held
                rc = <RegionCache*>b.region.cache
                if rc == NULL or rc_lends(rc):
                    f.servable += b.size
            b = b.seg_next
        seg = seg.next
    for i in range(st.regions.size()):
        rc = st.regions[i]
        if rc.live_bytes:
            f.owners.push_back(<uintptr_t>rc)
            f.owner_bytes.push_back(rc.live_bytes)
            f.owner_private.push_back(rc.held)
