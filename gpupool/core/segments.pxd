# Segments: how the pool's memory is laid out, grown, cut, joined and given back.
#
# * A request is rounded to 512 bytes and served by best fit from the free lists; a free
#   block larger than the request is cut (sg_split) and the rest stays free. On an expandable
#   upstream a small request (at most 1 MiB) without a near-exact fit goes just below a live
#   small block, cut from the top of the free block there (so_take_small, sg_split_top). A
#   freed block joins its free neighbours in its segment (sg_put), so pieces become one block
#   again.
# * Growth on a plain upstream ("driver", "async"): a new segment of the request rounded up to
#   the 2 MiB page (the driver maps whole pages anyway), or, for requests up to SEGMENT_FOR,
#   of up to SEGMENT_BYTES (an eighth of the pool's reserved bytes at most), so that small and
#   mid-sized blocks share segments and their frees can join. Under a hard limit that the
#   rounding would cross, the exact rounded request.
# * Growth on an expandable upstream ("vmm"): each stream has a segment, a range of address
#   space reserved once, whose pages are mapped as it grows, so free space at its end joins
#   the next request instead of fragmenting (sg_extend). A hole that a trim unmapped is mapped
#   again first when it and its free neighbours fit the request. Before it grows, the pages
#   of cold free blocks move to the growth when they cover it (sg_reclaim): reserved bytes
#   do not grow for memory the pool holds in pieces too small for the request.
# * A trim (sg_trim), after the device's work is done: plain segments wholly free go back to
#   the upstream; in expandable segments every whole free page is unmapped.
# * A plain segment whose CUDA IPC handle another process holds open stays (sg_imported):
#   freeing memory an importer has mapped is undefined behaviour in CUDA IPC (ipc/share.pyx).
# Everything here runs under the pool's lock; the counters of reserved and cached bytes are
# kept here (Counters); region tags of free blocks are kept with core/regioncache.pxd's functions;
# each segment event (growth, mapping, unmapping, giving back) is noted for the memory history
# (sg_note, history/ring.pxd).
from libc.stdint cimport uintptr_t, uint32_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.records.block cimport Block, Segment, LIVE, FREE, UNMAPPED
from gpupool.records.counters cimport Counters, count_reserved, count_returned
from gpupool.core.freelist cimport FreeLists, fl_put, fl_unbin, fl_each
from gpupool.records.ipcslot cimport gp_ipc_opened, gp_ipc_release
from gpupool.history.ring cimport (
    HistAction, ACT_SEGMENT_ALLOC, ACT_SEGMENT_FREE, ACT_SEGMENT_MAP,
    ACT_SEGMENT_UNMAP, hist_segment,
)
from gpupool.core.regioncache cimport RegionCache, rc_own, rc_disown
from gpupool.core.streamorder cimport StreamOrder, so_drop_events, so_unbind_all
from gpupool.records.streams cimport StreamKey, same_stream, is_no_stream, no_stream
from gpupool.upstream.base cimport Upstream


cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)     # C11; free() gives it back

cdef extern from *:
    """
    #define GP_PAGE_BYTES ((size_t)2 << 20)
    #define GP_SEGMENT_FOR ((size_t)10 << 20)
    #define GP_SEGMENT_BYTES ((size_t)20 << 20)
    """
    size_t PAGE_BYTES "GP_PAGE_BYTES"           # the driver's page: growth is rounded to it
    size_t SEGMENT_FOR "GP_SEGMENT_FOR"         # a request up to this size grows a segment
    size_t SEGMENT_BYTES "GP_SEGMENT_BYTES"     # of at most this size

cdef enum:
    BLOCK_ALIGN = 512           # requests are rounded to this; no block is smaller
    SEGMENT_SHARE = 8           # a shared segment is at most this share of reserved bytes
    COLD_ALLOCS = 128           # a free block untouched by this many allocations is cold

cdef cppclass Segments:
    Segment* head               # every segment of the pool
    vector[Block*] spare        # block records to reuse (cutting and joining allocate none)
    size_t hard_limit           # bytes the pool may reserve; 0: no limit
    int* recording              # the memory history's switch (_pool's copy: hist_subscribe)
    int device                  # the pool's device and id, for the memory history
    uint32_t pool_id


cdef inline void sg_note(Segments* sg, HistAction action, uintptr_t addr, size_t nbytes,
                         StreamKey s) noexcept nogil:
    """A segment event, for the memory history while it records."""
    if sg.recording[0]:
        hist_segment(sg.device, sg.pool_id, action, addr, nbytes, s.handle)


cdef inline size_t round_up(size_t n, size_t step) noexcept nogil:
    return (n + step - 1) // step * step


cdef inline size_t round_request(size_t nbytes) noexcept nogil:
    """The bytes a request of nbytes takes: rounded up to 512 (at most 511 more)."""
    return round_up(nbytes, BLOCK_ALIGN)


cdef inline Block* sg_record(Segments* sg, uintptr_t ptr, size_t size, Segment* seg) noexcept nogil:
    """A cleared block record, never used on any stream; NULL when the host has no memory."""
    cdef Block* b
    if not sg.spare.empty():
        b = sg.spare.back()
        sg.spare.pop_back()
        memset(b, 0, sizeof(Block))
    else:
        # A record of its own cache lines: threads write their blocks' at every allocate and
        # free (state, stream, holder), and two threads' records sharing a line slowed both.
        b = <Block*>aligned_alloc(64, round_up(sizeof(Block), 64))
        if b == NULL:
            return NULL
        memset(b, 0, sizeof(Block))
    b.ptr, b.size, b.segment, b.stream = ptr, size, seg, no_stream()
    return b


cdef inline void sg_retire(Segments* sg, StreamOrder* so, Block* b) noexcept nogil:
    """A block record no longer in use (its memory joined another block, or went back)."""
    so_drop_events(so, b)
    sg.spare.push_back(b)


cdef inline void sg_insert_after(Block* a, Block* b) noexcept nogil:
    """b becomes a's right neighbour in a's segment."""
    b.segment = a.segment
    b.seg_prev, b.seg_next = a, a.seg_next
    if a.seg_next != NULL:
        a.seg_next.seg_prev = b
    else:
        a.segment.last = b
    a.seg_next = b


cdef inline void sg_remove(Block* b) noexcept nogil:
    """Take b out of its segment's tiling."""
    if b.seg_prev != NULL:
        b.seg_prev.seg_next = b.seg_next
    else:
        b.segment.first = b.seg_next
    if b.seg_next != NULL:
        b.seg_next.seg_prev = b.seg_prev
    else:
        b.segment.last = b.seg_prev


# Cutting and joining ---------------------------------------------------------------------

cdef inline bint sg_joinable(Block* a, Block* b) noexcept nogil:
    """Whether free block b, a neighbour of free block a, may join it: both free, neither
    waits on record_stream events, free on one stream (or one was never used), and cached by
    one region, or one by the pool and the other by a region (not a private pool's) whose cap
    leaves room."""
    cdef RegionCache* rc
    if not (b.state == FREE and a.extra_events == NULL and b.extra_events == NULL
            and (same_stream(a.stream, b.stream) or is_no_stream(a.stream)
                 or is_no_stream(b.stream))):
        return False
    if a.region.cache == b.region.cache:
        return True
    if a.region.cache != NULL and b.region.cache != NULL:
        return False                    # two regions' blocks stay apart
    # A region's block takes in the pool's, within the region's cap; a private pool's does
    # not: it keeps what it allocated, no more.
    rc = <RegionCache*>(a.region.cache if a.region.cache != NULL else b.region.cache)
    if rc.held:
        return False
    return not rc.max_cached_bytes or \
        rc.cached_bytes + (b.size if a.region.cache != NULL else a.size) <= rc.max_cached_bytes


cdef inline void sg_join(Segments* sg, StreamOrder* so, Block* a, Block* b) noexcept nogil:
    """a takes in its right neighbour b (neither in the free lists): one block, on their
    stream, cached by the region that cached either (else by the pool). Two blocks of one
    stream drop their events: the one recorded when the block is next wanted elsewhere
    covers both."""
    cdef RegionCache* owner = rc_disown(a)
    cdef RegionCache* other = rc_disown(b)
    if owner == NULL:
        owner = other
    if is_no_stream(a.stream):
        a.stream = b.stream
        a.event, b.event = b.event, a.event
    elif not is_no_stream(b.stream):
        so_drop_events(so, a)
    if b.used > a.used:
        a.used = b.used
    a.size += b.size
    sg_remove(b)
    sg_retire(sg, so, b)
    rc_own(owner, a)


cdef inline Block* sg_put(Segments* sg, StreamOrder* so, FreeLists* fl, Block* b) noexcept nogil:
    """Put free block b (state FREE, tagged with its region or the pool) into the free lists,
    joined first with its free neighbours; returns the block it became."""
    cdef Block* n = b.seg_prev
    if n != NULL and sg_joinable(b, n):
        fl_unbin(fl, n)
        sg_join(sg, so, n, b)
        b = n
    n = b.seg_next
    if n != NULL and sg_joinable(b, n):
        fl_unbin(fl, n)
        sg_join(sg, so, b, n)
    fl_put(fl, b)
    return b


cdef inline void sg_split(Segments* sg, StreamOrder* so, FreeLists* fl, Block* b, size_t size,
                          StreamKey s, RegionCache* owner) noexcept nogil:
    """Cut a block just taken for stream s (out of the free lists; its earlier work is ordered
    before s's next) to size; the rest becomes a free block cached by owner (NULL: the
    pool), free on s (or for any stream, if the block was never used). The events b still
    has (s's own block: so_take keeps them) pass to the rest, whose earlier work they mark
    for other streams; the block taken drops them."""
    cdef Block* rest
    if b.size - size < BLOCK_ALIGN or size % BLOCK_ALIGN:
        so_drop_events(so, b)           # (an exact request under a hard limit serves whole)
        return
    rest = sg_record(sg, b.ptr + size, b.size - size, b.segment)
    if rest == NULL:
        so_drop_events(so, b)           # no host memory: the block serves whole
        return
    if not is_no_stream(b.stream):
        rest.stream = s
    rest.event, b.event = b.event, 0
    rest.extra_events = b.extra_events
    b.extra_events = NULL
    rest.used = b.used
    rest.state = FREE
    b.state = LIVE                      # not joinable with rest
    b.size = size
    sg_insert_after(b, rest)
    rc_own(owner, rest)
    sg_put(sg, so, fl, rest)


cdef inline Block* sg_split_top(Segments* sg, StreamOrder* so, FreeLists* fl, Block* b,
                                size_t size, StreamKey s, RegionCache* owner) noexcept nogil:
    """As sg_split, but the request takes b's top end (a small request placed below a small
    block: so_take_small): the rest, from b.ptr on, stays b, free, with b's events, on s (or
    for any stream, if b was never used) and cached by owner. Returns the block taken (b
    itself when it serves whole)."""
    cdef Block* top
    if b.size - size < BLOCK_ALIGN or size % BLOCK_ALIGN:
        so_drop_events(so, b)
        return b
    top = sg_record(sg, b.ptr + b.size - size, size, b.segment)
    if top == NULL:
        so_drop_events(so, b)           # no host memory: the block serves whole
        return b
    if not is_no_stream(b.stream):
        b.stream = s
    top.used = b.used
    top.state = LIVE                    # not joinable with the rest
    b.state = FREE
    b.size -= size
    sg_insert_after(b, top)
    rc_own(owner, b)
    sg_put(sg, so, fl, b)
    return top


# Growth -----------------------------------------------------------------------------------

cdef inline int sg_upstream_alloc(Segments* sg, Upstream up, Counters* c, size_t nbytes,
                                  StreamKey s, uintptr_t* ptr) noexcept nogil:
    """nbytes from a plain upstream for work on s, within the hard limit; counted."""
    cdef int r
    if sg.hard_limit and c.reserved + nbytes > sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = up.alloc(nbytes, s.handle, ptr)
    if r == 0:
        count_reserved(c, nbytes)
        sg_note(sg, ACT_SEGMENT_ALLOC, ptr[0], nbytes, s)
    return r


cdef inline Segment* sg_new_segment(Segments* sg, uintptr_t base, size_t nbytes,
                                    size_t va_bytes, StreamKey s) noexcept nogil:
    cdef Segment* seg = <Segment*>calloc(1, sizeof(Segment))
    if seg == NULL:
        return NULL
    seg.base, seg.nbytes, seg.va_bytes, seg.stream = base, nbytes, va_bytes, s
    seg.next = sg.head
    sg.head = seg
    return seg


cdef inline void sg_drop_segment(Segments* sg, Segment* seg) noexcept nogil:
    cdef Segment** p = &sg.head
    while p[0] != NULL and p[0] != seg:
        p = &p[0].next
    if p[0] == seg:
        p[0] = seg.next
    free(seg)


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


cdef inline int sg_allocate(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                            FreeLists* fl, size_t nbytes, StreamKey s) noexcept nogil:
    """Grow a plain upstream by a segment of nbytes for work on s; its block goes into the
    free lists (on s when the upstream is stream-ordered: the memory exists in s's order
    only, so other streams wait for it, else free for any stream)."""
    cdef uintptr_t ptr = 0
    cdef Segment* seg
    cdef Block* b
    cdef int r = sg_upstream_alloc(sg, up, c, nbytes, s, &ptr)
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
    sg_put(sg, so, fl, b)
    return 0


cdef inline int sg_grow_plain(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                              FreeLists* fl, size_t size, StreamKey s) noexcept nogil:
    """Grow a plain upstream for a request of size bytes: a shared segment (small and
    mid-sized requests), else the request's pages, else, under a hard limit, the exact
    request."""
    cdef size_t pages = round_up(size, PAGE_BYTES), shared
    cdef int r
    if size <= SEGMENT_FOR:
        shared = sg_shared_bytes(c)
        if shared > pages:
            r = sg_allocate(sg, up, c, so, fl, shared, s)
            if r != CUDA_ERROR_OUT_OF_MEMORY:
                return r
    r = sg_allocate(sg, up, c, so, fl, pages, s)
    if r == CUDA_ERROR_OUT_OF_MEMORY and pages != size and sg.hard_limit:
        r = sg_allocate(sg, up, c, so, fl, size, s)
    return r


cdef inline int sg_map(Segments* sg, Upstream up, Counters* c, uintptr_t va,
                       size_t nbytes, StreamKey s) noexcept nogil:
    """Map nbytes (whole pages) of reserved address space at va, in a segment of stream s;
    counted as reserved."""
    cdef int r
    if sg.hard_limit and c.reserved + nbytes > sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = up.map(va, nbytes)
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


cdef inline bint sg_fits_hole(Block* hole, size_t size, StreamKey s, void* owner,
                              size_t* avail) noexcept nogil:
    """Whether an unmapped hole and the free neighbours the request may join hold size
    bytes."""
    avail[0] = hole.size
    if sg_extends(hole.seg_prev, s, owner):
        avail[0] += hole.seg_prev.size
    if sg_extends(hole.seg_next, s, owner):
        avail[0] += hole.seg_next.size
    return avail[0] >= size


cdef inline int sg_fill_hole(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                             FreeLists* fl, size_t size, StreamKey s, void* owner) noexcept nogil:
    """Map the smallest unmapped hole of s's segments that, with the free neighbours the
    request may join, holds size bytes; 1 when there is none (nothing done), else a status
    code. The new pages are bound to s (they have no work: s may use them at once)."""
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
    r = sg_map(sg, up, c, best.ptr, best.size, s)
    if r != 0:
        return r
    best.used = c.num_allocs
    best.state = FREE
    best.stream = s                     # joins only neighbours the request may take
    rc_own(NULL, best)
    sg_put(sg, so, fl, best)
    return 0


cdef inline int sg_extend(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                          FreeLists* fl, size_t size, StreamKey s, void* owner) noexcept nogil:
    """Grow an expandable upstream for a request of size bytes on s made through cache owner
    (NULL: the pool): map a hole again, or map pages at the end of s's segment (reserving
    its address range first), joined with the free block at the end if the request may
    take it. New pages are bound to s (they have no work: s may use them at once)."""
    cdef Segment* seg
    cdef Block* tail
    cdef Block* b
    cdef uintptr_t va = 0
    cdef size_t need, have = 0
    cdef RegionCache* rc
    cdef int r = sg_fill_hole(sg, up, c, so, fl, size, s, owner)
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
    r = sg_map(sg, up, c, seg.base + seg.nbytes, need, s)
    if r != 0:
        if fresh:                       # an empty range is given back at once
            up.unreserve(seg.base)
            sg_drop_segment(sg, seg)
        return r
    if have:
        fl_unbin(fl, tail)
        rc = rc_disown(tail)            # its region's bytes grow with it
        tail.size += need
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
    sg_put(sg, so, fl, b)
    return 0


# Trimming ---------------------------------------------------------------------------------

cdef inline bint sg_imported(Segment* seg) noexcept nogil:
    """Whether another process holds seg open through CUDA IPC (its export slot's count of
    importers' mappings, in shared memory): it must not go back to the driver yet."""
    return seg.ipc != NULL and gp_ipc_opened(seg.ipc) > 0


cdef inline void sg_forget_export(Segment* seg) noexcept nogil:
    """seg goes back to the driver: a handle of it can no longer be opened."""
    if seg.ipc != NULL:
        gp_ipc_release(seg.ipc)
        seg.ipc = NULL


cdef inline size_t sg_unmap_free(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                                 FreeLists* fl, Block* b) noexcept nogil:
    """Unmap the whole pages of free block b of an expandable segment (its work is done):
    pages at the segment's end shrink it, others become an unmapped hole; the partial pages
    around them stay free. Returns the bytes unmapped."""
    cdef Segment* seg = b.segment
    cdef size_t g = up.granularity
    # Pages are counted from the segment's start (a range is aligned to the page there).
    cdef uintptr_t lo = seg.base + round_up(b.ptr - seg.base, g)
    cdef uintptr_t hi = seg.base + (b.ptr + b.size - seg.base) // g * g
    cdef Block* hole
    cdef Block* rest
    if hi <= lo:
        fl_put(fl, b)
        return 0
    if up.unmap(lo, hi - lo) != 0:
        up.clear_error()                # the pages stay mapped and cached
        fl_put(fl, b)
        return 0
    count_returned(c, hi - lo)
    sg_note(sg, ACT_SEGMENT_UNMAP, lo, hi - lo, seg.stream)
    if hi < b.ptr + b.size:             # the partial page after the pages stays free
        rest = sg_record(sg, hi, b.ptr + b.size - hi, seg)
        if rest != NULL:
            rest.state = FREE
            sg_insert_after(b, rest)
            fl_put(fl, rest)
    if lo > b.ptr:                      # and the one before them
        hole = sg_record(sg, lo, hi - lo, seg)
        b.size = lo - b.ptr
        fl_put(fl, b)
        if hole == NULL:
            return hi - lo              # unmapped all the same; the tiling keeps a gap
        sg_insert_after(b, hole)
    else:
        hole = b
        hole.size = hi - lo
    hole.state = UNMAPPED
    if hole.seg_prev != NULL and hole.seg_prev.state == UNMAPPED:     # one hole, not two
        b = hole.seg_prev
        b.size += hole.size
        sg_remove(hole)
        sg_retire(sg, so, hole)
        hole = b
    if hole.seg_next != NULL and hole.seg_next.state == UNMAPPED:
        b = hole.seg_next
        hole.size += b.size
        sg_remove(b)
        sg_retire(sg, so, b)
    if hole.seg_next == NULL:           # the segment's end: it shrinks
        seg.nbytes = hole.ptr - seg.base
        sg_remove(hole)
        sg_retire(sg, so, hole)
        if seg.first == NULL:
            up.unreserve(seg.base)
            sg_drop_segment(sg, seg)
    return hi - lo


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


cdef inline size_t sg_reclaim(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                              FreeLists* fl, size_t size, StreamKey s,
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
    cdef Segment* seg = sg_stream_segment(sg, s)
    cdef Block* b
    cdef vector[Block*] cold
    cdef size_t i, j, have = 0, need, total = 0, got = 0, g = up.granularity
    cdef bint capturing = True
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
    if total < need or up.stream_capturing(s.handle, &capturing) != 0 or capturing:
        up.clear_error()                # (a failed query counts as capturing)
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
        b.stream = no_stream()
        got += sg_unmap_free(sg, up, c, so, fl, b)
    return got


cdef inline void sg_rejoin(Segments* sg, StreamOrder* so, vector[Block*]* blocks,
                           vector[Block*]* runs) noexcept nogil:
    """After every event has completed, with blocks (all free, out of the free lists, free for
    any stream): join each run of joinable neighbours into its first; the runs go to runs."""
    cdef size_t i
    cdef Block* b
    for i in range(blocks.size()):
        b = blocks[0][i]
        if b.seg_prev == NULL or not sg_joinable(b, b.seg_prev):
            runs.push_back(b)           # the others are joined into these (and retired)
    for i in range(runs.size()):
        b = runs[0][i]
        while b.seg_next != NULL and sg_joinable(b, b.seg_next):
            sg_join(sg, so, b, b.seg_next)


cdef inline size_t sg_trim(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                           FreeLists* fl) noexcept nogil:
    """Give the pool's free memory back: wholly free plain segments to the upstream, whole
    free pages of expandable segments unmapped; blocks cached by regions stay. Synchronizes
    the device first when a cached block may still be read by queued work; what stays cached
    is then free for any stream. Returns the bytes given back."""
    cdef vector[Block*] blocks, runs
    cdef size_t i, before = c.reserved
    cdef Block* b
    cdef Segment* seg
    cdef bint busy = False
    fl_each(fl, &blocks)
    for i in range(blocks.size()):
        busy = busy or not is_no_stream(blocks[i].stream)
    blocks.clear()
    if busy or (up.expandable and fl.nblocks):
        # Cached blocks may still be read by work queued before their free; never-used ones
        # have no work, but pages are unmapped only with the device idle (a mapping change
        # under running work is not worth the risk). After this every event has completed.
        if up.synchronize() != 0:
            up.clear_error()
            return 0                    # the work may not be done: nothing is safe to free
        so.wanted.clear()
    so_unbind_all(so, fl, &blocks, NULL)
    sg_rejoin(sg, so, &blocks, &runs)
    for i in range(runs.size()):
        b = runs[i]
        seg = b.segment
        if b.region.cache != NULL:
            fl_put(fl, b)
        elif seg.va_bytes:
            sg_unmap_free(sg, up, c, so, fl, b)
        elif b.seg_prev == NULL and b.seg_next == NULL and not sg_imported(seg):
            sg_forget_export(seg)
            up.free(seg.base)
            count_returned(c, seg.nbytes)
            sg_note(sg, ACT_SEGMENT_FREE, seg.base, seg.nbytes, seg.stream)
            sg_drop_segment(sg, seg)
            sg_retire(sg, so, b)
        else:
            fl_put(fl, b)
    return before - c.reserved


cdef inline void sg_merge_streams(Segments* sg, StreamOrder* so, FreeLists* fl,
                                  size_t* moved) noexcept nogil:
    """After a device synchronize: every free block becomes free for any stream (neighbours
    freed on different streams join)."""
    cdef vector[Block*] blocks, runs
    cdef size_t i
    so_unbind_all(so, fl, &blocks, moved)
    sg_rejoin(sg, so, &blocks, &runs)
    for i in range(runs.size()):
        fl_put(fl, runs[i])


cdef inline void sg_release_all(Segments* sg, Upstream up, StreamOrder* so) noexcept nogil:
    """At the pool's end (no block live): give every segment back, drop every record."""
    cdef Segment* seg
    cdef Block* b
    cdef Block* nxt
    cdef uintptr_t start = 0
    cdef size_t i
    while sg.head != NULL:
        seg = sg.head
        b = seg.first
        start = seg.base
        while b != NULL:                # expandable: unmap each run of mapped pages
            nxt = b.seg_next
            if seg.va_bytes and b.state == UNMAPPED:
                if b.ptr > start:
                    up.unmap(start, b.ptr - start)
                    sg_note(sg, ACT_SEGMENT_UNMAP, start, b.ptr - start, seg.stream)
                start = b.ptr + b.size
            so_drop_events(so, b)
            free(b)
            b = nxt
        if seg.va_bytes:
            if seg.base + seg.nbytes > start:
                up.unmap(start, seg.base + seg.nbytes - start)
                sg_note(sg, ACT_SEGMENT_UNMAP, start, seg.base + seg.nbytes - start,
                        seg.stream)
            up.unreserve(seg.base)
        elif not sg_imported(seg):
            up.free(seg.base)
            sg_note(sg, ACT_SEGMENT_FREE, seg.base, seg.nbytes, seg.stream)
        # else: left allocated for the importers that hold it open (it goes with the process)
        sg_forget_export(seg)
        sg.head = seg.next
        free(seg)
    for i in range(sg.spare.size()):
        free(sg.spare[i])
    sg.spare.clear()
    up.clear_error()                    # at the end nothing reports a failure
