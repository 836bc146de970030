# Cutting and joining blocks of a segment (core/segments.pxd has the overview): block
# records, a segment's tiling, when two free neighbours may join, putting a free block into the
# free lists joined, and cutting a block taken for a request. Under the pool's lock.
from libc.stdint cimport uintptr_t
from libc.string cimport memset
from gpupool.records.block cimport Block, Segment, LIVE, FREE, RETIRED
from gpupool.core.freelist cimport FreeLists, fl_put, fl_unbin
from gpupool.core.regioncache cimport RegionCache, rc_own, rc_disown, rc_room
from gpupool.core.segments cimport BLOCK_ALIGN, round_up
from gpupool.core.state cimport PoolState, Segments, StreamOrder
from gpupool.core.streamorder cimport so_drop_events
from gpupool.records.streams cimport (
    StreamKey, NO_STREAM, BY_HANDLE, same_stream, is_no_stream, stream_key,
)


cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)     # C11; free() gives it back


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
    b.ptr, b.size, b.segment, b.stream = ptr, size, seg, stream_key(NO_STREAM, BY_HANDLE)
    return b


cdef inline void sg_retire(PoolState* st, Block* b) noexcept nogil:
    """A block record no longer in use (its memory joined another block, or went back): RETIRED,
    so that a plan's hint to it (core/planned.pxd's pl_block_at) is known stale."""
    cdef Segments* sg = &st.segments
    cdef StreamOrder* so = &st.order
    so_drop_events(so, b)
    b.state = RETIRED
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
    return rc_room(rc, b.size if a.region.cache != NULL else a.size)


cdef inline void sg_join(PoolState* st, Block* a, Block* b) noexcept nogil:
    """a takes in its right neighbour b (neither in the free lists): one block, on their
    stream, cached by the region that cached either (else by the pool). Two blocks of one
    stream drop their events: the one recorded when the block is next wanted elsewhere
    covers both."""
    cdef StreamOrder* so = &st.order
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
    sg_retire(st, b)
    rc_own(owner, a)


cdef inline Block* sg_put(PoolState* st, Block* b) noexcept nogil:
    """Put free block b (state FREE, tagged with its region or the pool) into the free lists,
    joined first with its free neighbours; returns the block it became."""
    return sg_put_for(st, b, True, NULL)


cdef inline Block* sg_put_for(PoolState* st, Block* b, bint any_owner,
                              void* owner) noexcept nogil:
    """sg_put; unless any_owner, b joins only neighbours cached by the pool or by owner (a
    region's cache; NULL: none): new memory mapped for a request made through owner, which
    another region's free neighbour would take in (sg_joinable) and the request could then
    not take (an entered region lends none)."""
    cdef FreeLists* fl = &st.free
    cdef Block* n = b.seg_prev
    if n != NULL and sg_joinable(b, n) and (any_owner or n.region.cache == NULL or
                                            n.region.cache == owner):
        fl_unbin(fl, n)
        sg_join(st, n, b)
        b = n
    n = b.seg_next
    if n != NULL and sg_joinable(b, n) and (any_owner or n.region.cache == NULL or
                                            n.region.cache == owner):
        fl_unbin(fl, n)
        sg_join(st, b, n)
    fl_put(fl, b)
    return b


cdef inline void sg_disown_joined(PoolState* st, Block* b) noexcept nogil:
    """Free block b, cached by a region, becomes the pool's, joined with its free neighbours
    that the pool caches: while b was the region's, a neighbour that another region cached
    (or that the region's cap refused) stayed apart, and once both are the pool's they are
    one block again, else a request of their joint size grows the pool beside them. b joins
    no region's block (that region's cache would grow by it). A parked b joins when it is
    put back."""
    rc_disown(b)
    if b.state == FREE and fl_unbin(&st.free, b):
        sg_put_for(st, b, False, NULL)


cdef inline void sg_return_unused(PoolState* st, RegionCache* rc) noexcept nogil:
    """At rc's exit: its cached blocks that the current entry did not use go back to the
    pool, joined (sg_disown_joined)."""
    cdef Block* b = rc.cached_head
    cdef Block* nxt
    while b != NULL:
        nxt = b.region.next             # (rc's: joins leave it as it is)
        if b.region.stamp != rc.entries:
            sg_disown_joined(st, b)
        b = nxt


cdef inline void sg_drain(PoolState* st, RegionCache* rc) noexcept nogil:
    """Every cached block of rc goes back to the pool, joined (sg_disown_joined)."""
    while rc.cached_head != NULL:
        sg_disown_joined(st, rc.cached_head)


cdef inline void sg_cut_after(Block* b, Block* rest, size_t size, StreamKey s) noexcept nogil:
    """rest, a new record of b's bytes from size on, follows b in its segment, with b's events
    (b keeps none) and its last use; on s unless b was never used. b keeps its first size
    bytes."""
    if not is_no_stream(b.stream):
        rest.stream = s
    rest.event, b.event = b.event, 0
    rest.extra_events = b.extra_events
    b.extra_events = NULL
    rest.used = b.used
    b.size = size
    sg_insert_after(b, rest)


cdef inline void sg_split(PoolState* st, Block* b, size_t size,
                          StreamKey s, RegionCache* owner) noexcept nogil:
    """Cut a block just taken for stream s (out of the free lists; its earlier work is ordered
    before s's next) to size; the rest becomes a free block cached by owner (NULL: the
    pool), free on s (or for any stream, if the block was never used). The events b still
    has (s's own block: so_take keeps them) pass to the rest, whose earlier work they mark
    for other streams; the block taken drops them."""
    cdef Segments* sg = &st.segments
    cdef StreamOrder* so = &st.order
    cdef Block* rest
    if b.size - size < BLOCK_ALIGN or size % BLOCK_ALIGN:
        so_drop_events(so, b)           # (an exact request under a hard limit serves whole)
        return
    rest = sg_record(sg, b.ptr + size, b.size - size, b.segment)
    if rest == NULL:
        so_drop_events(so, b)           # no host memory: the block serves whole
        return
    rest.state = FREE
    b.state = LIVE                      # not joinable with rest
    sg_cut_after(b, rest, size, s)
    rc_own(owner, rest)
    sg_put(st, rest)


cdef inline Block* sg_cut_front(PoolState* st, Block* b, uintptr_t ptr, StreamKey s,
                                RegionCache* owner) noexcept nogil:
    """Free block b, out of the free lists and untagged, with no record_stream events (its
    front would go back free without them: the caller sends such a request elsewhere before
    it waits on them), holds ptr > b.ptr, a multiple of 512
    bytes above it: its front [b.ptr, ptr) goes back into the free lists, cached by owner, and
    the rest, from ptr on, is returned out of the lists and untagged (LIVE, so that the two do
    not join), with b's events (the front keeps none); NULL when b could not be cut (no host
    memory for a record: b goes back whole). The rest never enters the free lists: a bin's
    insert and erase touch a block record per step of their binary searches."""
    cdef Block* rest
    cdef size_t front = ptr - b.ptr
    rest = NULL
    if front % BLOCK_ALIGN == 0 and b.size - front >= BLOCK_ALIGN:
        rest = sg_record(&st.segments, ptr, b.size - front, b.segment)
    if rest == NULL:
        rc_own(owner, b)
        sg_put(st, b)
        return NULL
    rest.state = LIVE
    b.state = FREE
    sg_cut_after(b, rest, front, s)
    rc_own(owner, b)
    sg_put(st, b)
    return rest


cdef inline Block* sg_split_top(PoolState* st, Block* b,
                                size_t size, StreamKey s, RegionCache* owner) noexcept nogil:
    """As sg_split, but the request takes b's top end (a small request placed below a small
    block: so_take_small): the rest, from b.ptr on, stays b, free, with b's events, on s (or
    for any stream, if b was never used) and cached by owner. Returns the block taken (b
    itself when it serves whole)."""
    cdef Segments* sg = &st.segments
    cdef StreamOrder* so = &st.order
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
    sg_put(st, b)
    return top
