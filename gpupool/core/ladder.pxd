# Growth and giving back as the pool runs them: one growth of the upstream for a request, the
# out-of-memory ladder (give this pool's cache back and grow again, then every region's), trims
# and stream merges (every magazine and parked block goes to the free lists first, so that they
# see the whole free memory). Under the pool's lock.
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.history.ring cimport (
    LogKind, LOG_LADDER_NOTHING, LOG_LADDER_TRIM, LOG_LADDER_REGIONS, hist_log,
)
from gpupool.records.streams cimport StreamKey
from gpupool.core.cutjoin cimport sg_drain
from gpupool.core.giveback cimport Refused, sg_trim, sg_merge_streams
from gpupool.core.growexpand cimport sg_extend, sg_reclaim
from gpupool.core.growplain cimport sg_grow_plain
from gpupool.core.magpool cimport mp_flush_all
from gpupool.core.parking cimport pk_flush
from gpupool.core.state cimport PoolState
from gpupool.core.streamorder cimport so_capturing
from gpupool.upstream.base cimport Upstream


cdef inline int ld_ladder(PoolState* st, Upstream up, size_t size, StreamKey s,
                          void* owner) noexcept nogil:
    """The upstream is out of memory for a request of size bytes on s (made through cache
    owner): give back this pool's cache and grow again, then every region's. Nothing while
    s is being captured into a CUDA graph: a trim synchronizes the device, which would
    invalidate the capture (the request fails as out of memory; Note [Capture in a planned
    region])."""
    cdef int r = CUDA_ERROR_OUT_OF_MEMORY
    cdef size_t i, released
    if st.counters.cached and so_capturing(up, s):
        return r
    if not st.counters.cached:
        hist_log(LOG_LADDER_NOTHING, st.segments.device, size, 0, r)
    if st.counters.cached:
        st.counters.oom_retries += 1
        released = ld_trim(st, up, NULL)
        r = ld_grow_once(st, up, size, s, owner)
        hist_log(LOG_LADDER_TRIM, st.segments.device, size, released, r)
    if r == CUDA_ERROR_OUT_OF_MEMORY and st.counters.cached:
        st.counters.oom_retries += 1
        for i in range(st.regions.size()):
            sg_drain(st, st.regions[i])
        released = ld_trim(st, up, NULL)
        r = ld_grow_once(st, up, size, s, owner)
        hist_log(LOG_LADDER_REGIONS, st.segments.device, size, released, r)
    return r


cdef inline int ld_grow_once(PoolState* st, Upstream up, size_t size, StreamKey s,
                             void* owner) noexcept nogil:
    """Grow the upstream for a request of size bytes on s (through cache owner: NULL,
    the pool). On an expandable one, the pool's cold free pages move to the growth first
    (sg_reclaim)."""
    if up.expandable:
        sg_reclaim(st, up, size, s, owner)
        return sg_extend(st, up, size, s, owner)
    return sg_grow_plain(st, up, size, s)


cdef inline size_t ld_trim(PoolState* st, Upstream up, Refused* refused) noexcept nogil:
    """Give the pool's cached memory back (sg_trim: refused gets what the upstream refused,
    NULL: nothing); returns the bytes given back."""
    mp_flush_all(st)
    pk_flush(st)
    return sg_trim(st, up, refused)


cdef inline void ld_trim_logged(PoolState* st, Upstream up, LogKind kind, size_t bound,
                                StreamKey s) noexcept nogil:
    """ld_trim for a reason the debug log names (kind; bound: the limit crossed), made by a
    request on s; none while s is being captured into a CUDA graph (its synchronize would
    invalidate the capture: the trim waits for a request outside it)."""
    if not so_capturing(up, s):
        hist_log(kind, st.segments.device, bound, ld_trim(st, up, NULL), 0)


cdef inline int ld_merge_streams(PoolState* st, Upstream up, size_t* moved) noexcept nogil:
    """Synchronize the device, then make every free block free for any stream (a status
    code: the synchronize's); moved counts those that were bound to a stream."""
    cdef int r = up.synchronize()
    if r != 0:
        return r
    st.order.wanted.clear()
    mp_flush_all(st)
    pk_flush(st)
    sg_merge_streams(st, moved)
    return 0

