# Growth on an expandable upstream ("vmm"): per stream, a range of address space whose
# pages are mapped as it grows; holes a trim unmapped are mapped again; cold free pages move to
# the growth (core/segments.pxd has the overview). Under the pool's lock.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.records.block cimport Block, Segment, FREE, UNMAPPED
from gpupool.records.counters cimport Counters, count_reserved, count_returned
from gpupool.history.ring cimport ACT_SEGMENT_MAP, ACT_SEGMENT_UNMAP
from gpupool.driver.status cimport GP_PY_ERROR
from gpupool.core.cutjoin cimport sg_record, sg_insert_after, sg_put_for
from gpupool.core.freelist cimport FreeLists, fl_unbin
from gpupool.core.giveback cimport sg_unmap_free
from gpupool.core.regioncache cimport RegionCache, rc_own, rc_disown, rc_room
from gpupool.core.segments cimport (
    COLD_ALLOCS, round_up, sg_note, sg_new_segment, sg_drop_segment,
)
from gpupool.core.state cimport PoolState, Segments, StreamOrder
from gpupool.core.streamorder cimport so_capturing, so_drop_events
from gpupool.records.streams cimport (
    StreamKey, NO_STREAM, BY_HANDLE, same_stream, is_no_stream, stream_key,
)
from gpupool.upstream.base cimport Upstream


cdef inline int sg_map(PoolState* st, Upstream up, uintptr_t va, size_t nbytes, StreamKey s,
                       bint chunk=False) noexcept nogil:
    """Map nbytes (whole pages) of a range's address space at va, in a segment of stream s;
    counted as reserved. chunk: as one physical allocation (a tagged segment's, unmapped only
    whole), else a page each (a trim unmaps single pages)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef int r
    if sg.hard_limit and c.reserved + nbytes > sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = up.map_chunk(va, nbytes) if chunk else up.map(va, nbytes)
    if r == 0:
        count_reserved(c, nbytes)
        sg_note(sg, ACT_SEGMENT_MAP, va, nbytes, s)
    return r


cdef inline Segment* sg_stream_segment(Segments* sg, StreamKey s) noexcept nogil:
    """The expandable segment a request on s grows (the newest of s's)."""
    cdef Segment* seg = sg.head
    while seg != NULL:
        if seg.va_bytes and same_stream(seg.stream, s):
            return seg
        seg = seg.next
    return NULL


cdef inline bint sg_extends(Block* b, StreamKey s, void* owner) noexcept nogil:
    """Whether new memory next to b may join it for a request on s through cache owner: b is
    free, on s or never used, with no record_stream events, the pool's or owner's."""
    return (b != NULL and b.state == FREE and b.extra_events == NULL
            and (same_stream(b.stream, s) or is_no_stream(b.stream))
            and (b.region.cache == NULL or b.region.cache == owner))


cdef inline bint sg_joins_hole(Block* b, StreamKey s, void* owner) noexcept nogil:
    """Whether a mapped hole's pages (the pool's) surely join free neighbour b: sg_extends, and
    b no region's with a cap on its cache (those join the pool's only within the cap:
    cutjoin.pxd's sg_joinable; counted, a refused join left the request no room)."""
    return sg_extends(b, s, owner) and (
        b.region.cache == NULL or not (<RegionCache*>b.region.cache).max_cached_bytes)


cdef inline bint sg_fits_hole(Block* hole, size_t size, StreamKey s, void* owner,
                              size_t* avail) noexcept nogil:
    """Whether an unmapped hole and the free neighbours the request surely joins hold size
    bytes."""
    avail[0] = hole.size
    if sg_joins_hole(hole.seg_prev, s, owner):
        avail[0] += hole.seg_prev.size
    if sg_joins_hole(hole.seg_next, s, owner):
        avail[0] += hole.seg_next.size
    return avail[0] >= size


cdef inline int sg_fill_hole(PoolState* st, Upstream up, size_t size, StreamKey s, void* owner) noexcept nogil:
    """Map the smallest unmapped hole of s's segments that, with the free neighbours the
    request may join, holds size bytes; 1 when there is none (nothing done), else a status
    code. The new pages are bound to s (they have no work: s may use them at once)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef Segment* seg = sg.head
    cdef Block* b
    cdef Block* best = NULL
    cdef size_t avail, best_avail = 0
    cdef int r
    while seg != NULL:
        if seg.va_bytes and same_stream(seg.stream, s):
            b = seg.first
            while b != NULL:
                if b.state == UNMAPPED and sg_fits_hole(b, size, s, owner, &avail) and \
                        (best == NULL or avail < best_avail):
                    best, best_avail = b, avail
                b = b.seg_next
        seg = seg.next
    if best == NULL:
        return 1
    r = sg_map(st, up, best.ptr, best.size, s)
    if r != 0:
        return r
    best.used = c.num_allocs
    best.state = FREE
    best.stream = s                     # joins only neighbours the request may take
    rc_own(NULL, best)
    sg_put_for(st, best, False, owner)
    return 0


cdef inline int sg_extend(PoolState* st, Upstream up, size_t size, StreamKey s, void* owner) noexcept nogil:
    """Grow an expandable upstream for a request of size bytes on s made through cache owner
    (NULL: the pool): map a hole again, or map pages at the end of s's segment (reserving
    its address range first), joined with the free block at the end if the request may
    take it. New pages are bound to s (they have no work: s may use them at once)."""
    cdef Segments* sg = &st.segments
    cdef Segment* seg
    cdef Block* tail
    cdef uintptr_t va = 0
    cdef size_t need, have = 0
    cdef int r = sg_fill_hole(st, up, size, s, owner)
    cdef bint fresh = False
    if r != 1:
        return r
    if round_up(size, up.granularity) > up.va_bytes:
        return CUDA_ERROR_OUT_OF_MEMORY         # larger than the device
    seg = sg_stream_segment(sg, s)
    tail = seg.last if seg != NULL else NULL
    if sg_extends(tail, s, owner) and tail.size < size:
        have = tail.size
    need = round_up(size - have, up.granularity)
    if seg == NULL or seg.nbytes + need > seg.va_bytes:
        # A new range (a full one gets a successor), the device's memory in size.
        r = up.reserve(&va)
        if r != 0:
            return r
        seg = sg_new_segment(sg, va, 0, up.va_bytes, s)
        if seg == NULL:
            up.unreserve(va)
            return CUDA_ERROR_OUT_OF_MEMORY
        fresh = True
        tail = NULL
        have = 0
        need = round_up(size, up.granularity)
    r = sg_map_end(st, up, seg, need, s, tail if have else NULL, owner)
    if r != 0 and fresh and seg.nbytes == 0:    # an empty range is given back at once
        if up.unreserve(seg.base) != 0 and r != GP_PY_ERROR:
            up.clear_error()            # it stays reserved (address space, no memory)
        sg_drop_segment(sg, seg)
    return r


cdef inline int sg_map_end(PoolState* st, Upstream up, Segment* seg, size_t need, StreamKey s,
                           Block* tail, void* owner) noexcept nogil:
    """Map need bytes (whole pages) at the end of expandable segment seg for stream s, for a
    request made through cache owner (NULL: the pool), joined with tail (seg's free last
    block, which the request may take: sg_extends; a region's stays its own within the
    region's cap, else becomes the pool's) or, tail NULL, as a free block of the pool's,
    which joins no other region's free block. The new pages are bound to s (they
    have no work). Returns 0 or a status code (nothing mapped then)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef RegionCache* rc
    cdef Block* b
    cdef int r = sg_map(st, up, seg.base + seg.nbytes, need, s)
    if r != 0:
        return r
    if tail != NULL:
        fl_unbin(&st.free, tail)
        rc = rc_disown(tail)            # its region's bytes grow with it, up to its cap
        tail.size += need
        if rc != NULL and not rc_room(rc, tail.size):
            rc = NULL                   # past it: the block is the pool's (the request takes it)
        rc_own(rc, tail)
        b = tail
    else:
        b = sg_record(sg, seg.base + seg.nbytes, need, seg)
        if b == NULL:
            up.unmap(seg.base + seg.nbytes, need)
            count_returned(c, need)
            sg_note(sg, ACT_SEGMENT_UNMAP, seg.base + seg.nbytes, need, s)
            return CUDA_ERROR_OUT_OF_MEMORY
        if seg.last != NULL:
            sg_insert_after(seg.last, b)
        else:
            seg.first = seg.last = b
        b.used = c.num_allocs
        b.state = FREE
        b.stream = s                    # joins only a free end the request may take
        rc_own(NULL, b)
    seg.nbytes += need
    sg_put_for(st, b, False, owner)
    return 0


cdef inline size_t sg_whole_pages(Block* b, size_t g) noexcept nogil:
    """Bytes of the whole pages inside block b of an expandable segment (pages are counted
    from the segment's start)."""
    cdef uintptr_t base = b.segment.base
    cdef uintptr_t lo = base + round_up(b.ptr - base, g)
    cdef uintptr_t hi = base + (b.ptr + b.size - base) // g * g
    return hi - lo if hi > lo else 0


cdef inline bint sg_cold(Block* b, StreamKey s, Counters* c, size_t g,
                         void* owner) noexcept nogil:
    """Whether free block b of s's expandable segment may give its pages to s's growth for a
    request made through cache owner: one the growth could join (sg_extends: the pool's or
    owner's, on s or never used, no record_stream events), not a private pool's (a captured
    graph reads its memory), not the segment's last block (growth joins that one), holding a
    whole page, and untouched by the last COLD_ALLOCS allocations (a step that reuses it
    would cut it again soon). Other regions' cached blocks never move."""
    return (sg_extends(b, s, owner) and b.seg_next != NULL
            and (b.region.cache == NULL or not (<RegionCache*>owner).held)
            and c.num_allocs - b.used >= COLD_ALLOCS and sg_whole_pages(b, g) > 0)


cdef inline size_t sg_reclaim(PoolState* st, Upstream up, size_t size, StreamKey s,
                              void* owner) noexcept nogil:
    """Before s's expandable segment grows for a request of size bytes made through cache
    owner (NULL: the pool), move free pages instead of adding new ones: when the cold free
    blocks of s's segments (sg_cold: the pool's and the requesting region's own) hold at
    least the whole pages the growth would map and s is not being captured into a CUDA graph
    (a synchronize would invalidate the capture), synchronize the device and unmap the pages
    of the largest of them until they cover it (a region's block leaves its cache). The
    growth then maps as many new pages, at the segment's end or in a hole, so the pool's
    reserved bytes do not grow for memory it already has in pieces too small for the request
    (ViT-B/16: a 37.1 MiB request while 151 MiB were free, the largest piece 36.9 MiB).
    Returns the bytes unmapped (0: nothing done, no synchronize). Pages are unmapped with the
    device idle, as a trim does (sg_trim)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef StreamOrder* so = &st.order
    cdef FreeLists* fl = &st.free
    cdef Segment* seg = sg_stream_segment(sg, s)
    cdef Block* b
    cdef vector[Block*] cold
    cdef size_t i, j, have = 0, need, total = 0, got = 0, g = up.granularity
    if seg == NULL:
        return 0
    b = seg.last
    if sg_extends(b, s, owner) and b.size < size:
        have = b.size
    need = round_up(size - have, g)
    seg = sg.head
    while seg != NULL:
        if seg.va_bytes and same_stream(seg.stream, s):
            b = seg.first
            while b != NULL:
                if sg_cold(b, s, c, g, owner):
                    cold.push_back(b)
                    total += sg_whole_pages(b, g)
                b = b.seg_next
        seg = seg.next
    if total < need or so_capturing(up, s):
        return 0
    for i in range(1, cold.size()):     # largest first (insertion sort: a few blocks)
        b = cold[i]
        j = i
        while j > 0 and cold[j - 1].size < b.size:
            cold[j] = cold[j - 1]
            j -= 1
        cold[j] = b
    if up.synchronize() != 0:
        up.clear_error()
        return 0
    for i in range(cold.size()):
        if got >= need:
            break
        b = cold[i]
        fl_unbin(fl, b)
        rc_disown(b)                    # (the requesting region's: its pages leave it)
        so_drop_events(so, b)           # its work is done
        b.stream = stream_key(NO_STREAM, BY_HANDLE)
        got += sg_unmap_free(st, up, b, NULL)
    return got
