# Growth on a plain upstream ("driver", "async"): a new segment per growth, shared by small and
# mid-sized requests (core/segments.pxd has the overview). Under the pool's lock.
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.records.block cimport Block, Segment, FREE
from gpupool.records.counters cimport Counters, count_reserved, count_returned
from gpupool.history.ring cimport ACT_SEGMENT_ALLOC, ACT_SEGMENT_FREE
from gpupool.core.cutjoin cimport sg_record, sg_put
from gpupool.core.giveback cimport sg_shed
from gpupool.core.regioncache cimport rc_own
from gpupool.core.segments cimport (
    PAGE_BYTES, SEGMENT_FOR, SEGMENT_BYTES, SEGMENT_SHARE, round_up, sg_note, sg_new_segment,
    sg_drop_segment,
)
from gpupool.core.state cimport PoolState, Segments
from gpupool.records.streams cimport StreamKey
from gpupool.upstream.base cimport Upstream

cdef enum:
    CREEP_BOUND = 2             # reserved bytes past this many times the peak in use: shed


cdef inline int sg_upstream_alloc(PoolState* st, Upstream up, size_t nbytes,
                                  StreamKey s, uintptr_t* ptr) noexcept nogil:
    """nbytes from a plain upstream for work on s, within the hard limit; counted."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef int r
    if sg.hard_limit and c.reserved + nbytes > sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = up.alloc(nbytes, s.handle, ptr)
    if r == 0:
        count_reserved(c, nbytes)
        sg_note(sg, ACT_SEGMENT_ALLOC, ptr[0], nbytes, s)
    return r


cdef inline Block* sg_first_block(Segments* sg, Segment* seg, uintptr_t ptr,
                                  size_t size) noexcept nogil:
    """The one block of a segment that has none yet."""
    cdef Block* b = sg_record(sg, ptr, size, seg)
    if b != NULL:
        seg.first = seg.last = b
    return b


cdef inline size_t sg_shared_bytes(Counters* c) noexcept nogil:
    """Bytes of a segment that small and mid-sized requests share: an eighth of what the
    pool reserves, in pages, at most SEGMENT_BYTES; so the unused end of the latest segment
    stays a small share of the pool."""
    cdef size_t seg = (c.reserved // SEGMENT_SHARE) // PAGE_BYTES * PAGE_BYTES
    return seg if seg < SEGMENT_BYTES else SEGMENT_BYTES


cdef inline int sg_add_segment(PoolState* st, Upstream up, size_t nbytes,
                                StreamKey s) noexcept nogil:
    """Grow a plain upstream by a segment of nbytes for work on s; its block goes into the
    free lists (on s when the upstream is stream-ordered: the memory exists in s's order
    only, so other streams wait for it, else free for any stream)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef uintptr_t ptr = 0
    cdef Segment* seg
    cdef Block* b
    cdef int r = sg_upstream_alloc(st, up, nbytes, s, &ptr)
    if r != 0:
        return r
    seg = sg_new_segment(sg, ptr, nbytes, 0, s)
    b = sg_first_block(sg, seg, ptr, nbytes) if seg != NULL else NULL
    if b == NULL:
        if seg != NULL:
            sg_drop_segment(sg, seg)
        up.free(ptr)
        count_returned(c, nbytes)
        sg_note(sg, ACT_SEGMENT_FREE, ptr, nbytes, s)
        return CUDA_ERROR_OUT_OF_MEMORY
    if up.stream_ordered:
        b.stream = s
    b.state = FREE
    rc_own(NULL, b)
    sg_put(st, b)
    return 0


cdef inline bint sg_creeping(Counters* c, size_t size, size_t pages) noexcept nogil:
    """Whether a growth of pages bytes for a request of size bytes would take the pool's
    reserved bytes past CREEP_BOUND times its peak in use (this request counted)."""
    cdef size_t peak = c.in_use + size
    if peak < c.peak_in_use:
        peak = c.peak_in_use
    return c.reserved + pages > CREEP_BOUND * peak


cdef inline int sg_grow_plain(PoolState* st, Upstream up, size_t size, StreamKey s) noexcept nogil:
    """Grow a plain upstream for a request of size bytes: a shared segment (small and
    mid-sized requests), else the request's pages, else, under a hard limit, the exact
    request. A growth that would take reserved bytes past CREEP_BOUND times the peak in use
    first gives back the wholly free segments too small for the request whose work is done
    (sg_shed): requests that creep upward (a buffer growing a little every step) otherwise
    add a segment at every page they cross while the old ones sit free, 6.8x the peak in use
    on bench/creep.py's loop (see Note [Creeping requests on a plain upstream] in
    docs/design.md). Below the bound the cache stays whole: a segment given back and
    allocated again costs a cuMemFree (which waits for the device) and a cuMemAlloc."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef size_t pages = round_up(size, PAGE_BYTES), shared
    cdef int r
    if sg_creeping(c, size, pages):
        sg_shed(st, up, size, s)
    if size <= SEGMENT_FOR:
        shared = sg_shared_bytes(c)
        if shared > pages:
            r = sg_add_segment(st, up, shared, s)
            if r != CUDA_ERROR_OUT_OF_MEMORY:
                return r
    r = sg_add_segment(st, up, pages, s)
    if r == CUDA_ERROR_OUT_OF_MEMORY and pages != size and sg.hard_limit:
        r = sg_add_segment(st, up, size, s)
    return r
