# Tagged memory (docs/design.md, Note [Sleep and wake]): on an expandable upstream each tag has
# a segment of its own, a range of address space whose pages hold only that tag's blocks, so
# that Pool.sleep can unmap them without touching other blocks. A tagged request never reaches
# the free lists, magazines, parking or regions: its free blocks (state TAGGED) stay in its
# segment, where only requests of the same tag on the same stream (or never used) take them.
# Under the pool's lock.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.driver.status cimport GP_ASLEEP
from gpupool.records.block cimport Block, Segment, LIVE, TAGGED
from gpupool.records.counters cimport Counters, count_freed, count_returned, add_with_peak
from gpupool.records.streams cimport (
    StreamKey, NO_STREAM, BY_HANDLE, same_stream, is_no_stream, stream_key, unordered,
)
from gpupool.history.ring cimport hist_on, hist_free
from gpupool.core.cutjoin cimport sg_record, sg_insert_after, sg_remove, sg_retire
from gpupool.core.growexpand cimport sg_map
from gpupool.core.ladder cimport ld_trim
from gpupool.core.magpool cimport mp_count_taken, mp_hand_out, mp_settle_peak
from gpupool.core.segments cimport BLOCK_ALIGN, round_up, round_request, sg_new_segment
from gpupool.core.state cimport PoolState, Segments
from gpupool.core.streamorder cimport so_capturing
from gpupool.core.offload cimport of_free
from gpupool.upstream.base cimport Upstream

cdef enum:
    TAGS_MAX = 255              # tag ids are 1..TAGS_MAX (0: untagged; core/tags.py names them)


cdef inline Segment* tg_segment(Segments* sg, int tag) noexcept nogil:
    """The segment of tag's blocks, or NULL (none allocated yet)."""
    cdef Segment* seg = sg.head
    while seg != NULL and seg.tag != tag:
        seg = seg.next
    return seg


cdef inline bint tg_fits(Block* b, size_t size, StreamKey s) noexcept nogil:
    """Whether free tagged block b may serve a request of size bytes on s: its last use was
    on s, or it was never used (no cross-stream reuse: no event is needed)."""
    return (b.state == TAGGED and b.size >= size
            and (same_stream(b.stream, s) or is_no_stream(b.stream)))


cdef inline int tg_grow(PoolState* st, Upstream up, Segment** segp, size_t size,
                        int tag) noexcept nogil:
    """Map pages at the end of tag's segment (reserving its range first), as one chunk, so
    that its last block, free, holds size bytes; the segment goes to segp. Returns 0 or a
    status code."""
    cdef Segments* sg = &st.segments
    cdef Segment* seg = segp[0]
    cdef Block* tail
    cdef Block* b
    cdef uintptr_t va = 0
    cdef size_t have = 0, need
    cdef int r
    if seg == NULL:
        if round_up(size, up.granularity) > up.va_bytes:
            return CUDA_ERROR_OUT_OF_MEMORY
        r = up.reserve(&va)
        if r != 0:
            return r
        seg = sg_new_segment(sg, va, 0, up.va_bytes, StreamKey(NO_STREAM, <uintptr_t>tag))
        if seg == NULL:
            up.unreserve(va)
            return CUDA_ERROR_OUT_OF_MEMORY
        seg.tag = tag
        segp[0] = seg
    tail = seg.last
    if tail != NULL and tail.state == TAGGED and is_no_stream(tail.stream):
        have = tail.size
    need = round_up(size - have, up.granularity)
    if seg.nbytes + need > seg.va_bytes:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = sg_map(st, up, seg.base + seg.nbytes, need, seg.stream, True)
    if r == CUDA_ERROR_OUT_OF_MEMORY and ld_trim(st, up, NULL):
        # The pool's cached memory goes back first (the ladder's first rung), once.
        r = sg_map(st, up, seg.base + seg.nbytes, need, seg.stream, True)
    if r != 0:
        return r
    if have:
        tail.size += need
    else:
        b = sg_record(sg, seg.base + seg.nbytes, need, seg)
        if b == NULL:
            up.unmap(seg.base + seg.nbytes, need)
            count_returned(&st.counters, need)
            return CUDA_ERROR_OUT_OF_MEMORY
        b.state = TAGGED
        b.tag = tag
        if seg.last != NULL:
            sg_insert_after(seg.last, b)
        else:
            seg.first = seg.last = b
    seg.nbytes += need
    return 0


cdef inline bint tg_captured(Upstream up, StreamKey s, vector[StreamKey]* others,
                             vector[StreamKey]* waits) noexcept nogil:
    """Whether s or one of others is being captured into a CUDA graph; those that are are
    added to waits."""
    cdef size_t i
    cdef bint found = so_capturing(up, s)
    if found:
        tg_wait_for(waits, s)
    for i in range(others.size()):
        if so_capturing(up, others[0][i]):
            tg_wait_for(waits, others[0][i])
            found = True
    return found


cdef inline void tg_wait_for(vector[StreamKey]* waits, StreamKey s) noexcept nogil:
    """s joins waits, once."""
    cdef size_t i
    for i in range(waits.size()):
        if same_stream(waits[0][i], s):
            return
    waits.push_back(s)


cdef inline void tg_reorder(PoolState* st, Upstream up, StreamKey s) noexcept nogil:
    """Before a tagged request on s: tagged blocks freed under a capture after record_stream
    (tg_free) wait, unordered, for a device synchronize; it is made here once neither s nor
    a stream whose capture they waited for is being captured (one whose query fails is gone,
    its capture over), and then every free tagged block is free for any stream (joined with
    its free neighbours). A failed synchronize leaves them waiting."""
    cdef Segment* seg = st.segments.head
    cdef Block* b
    cdef size_t i
    cdef bint capturing
    if st.tag_waits.empty() or so_capturing(up, s):
        return
    for i in range(st.tag_waits.size()):
        if up.stream_capturing(st.tag_waits[i].handle, &capturing) != 0:
            up.clear_error()
        elif capturing:
            return
    if up.synchronize() != 0:
        up.clear_error()
        return
    st.tag_waits.clear()
    while seg != NULL:
        b = seg.first if seg.tag else NULL
        while b != NULL:
            if b.state == TAGGED:
                # Its free neighbours join it as free for any stream too (tg_join would give
                # it theirs: an unordered one's would leave the whole block waiting).
                b.stream = stream_key(NO_STREAM, BY_HANDLE)
                while b.seg_next != NULL and b.seg_next.state == TAGGED:
                    b.seg_next.stream = b.stream
                    tg_join(st, b, b.seg_next)
            b = b.seg_next
        seg = seg.next


cdef inline int tg_acquire(PoolState* st, Upstream up, size_t nbytes, StreamKey s, int tag,
                           Block** out) noexcept nogil:
    """Under the pool's lock: a live block of nbytes > 0 for tag on s, best fit among the
    tag's free blocks s may take, else from new pages at its segment's end. Returns 0,
    GP_ASLEEP (the tag sleeps), or a status code."""
    cdef Segment* seg = tg_segment(&st.segments, tag)
    cdef Block* b
    cdef Block* best = NULL
    cdef Block* rest
    cdef size_t size = round_request(nbytes)
    cdef bint grew = False
    cdef int r
    if seg != NULL and seg.asleep:
        return GP_ASLEEP
    tg_reorder(st, up, s)
    if seg != NULL:
        b = seg.first
        while b != NULL:
            if tg_fits(b, size, s) and (best == NULL or b.size < best.size):
                best = b
            b = b.seg_next
    if best == NULL:
        r = tg_grow(st, up, &seg, size, tag)
        if r != 0:
            return r
        best = seg.last
        grew = True
    if best.size - size >= BLOCK_ALIGN:
        rest = sg_record(&st.segments, best.ptr + size, best.size - size, seg)
        if rest != NULL:                        # (no record: the block stays whole)
            rest.state, rest.tag, rest.stream, rest.used = TAGGED, tag, best.stream, best.used
            best.size = size
            sg_insert_after(best, rest)
    mp_hand_out(st, best, s, grew)
    mp_count_taken(st, best.size)
    out[0] = best
    return 0


cdef inline bint tg_joins(Block* a, Block* b) noexcept nogil:
    """Whether free tagged neighbours a and b may be one block: one stream, or one unused."""
    return (b != NULL and b.state == TAGGED
            and (same_stream(a.stream, b.stream) or is_no_stream(a.stream)
                 or is_no_stream(b.stream)))


cdef inline void tg_join(PoolState* st, Block* a, Block* b) noexcept nogil:
    """a takes in its right neighbour b (both free, tg_joins)."""
    if is_no_stream(a.stream):
        a.stream = b.stream
    if b.used > a.used:
        a.used = b.used
    a.size += b.size
    sg_remove(b)
    sg_retire(st, b)


cdef inline size_t tg_live_bytes(Segment* seg) noexcept nogil:
    """Bytes of seg's live blocks."""
    cdef Block* b = seg.first
    cdef size_t live = 0
    while b != NULL:
        if b.state == LIVE:
            live += b.size
        b = b.seg_next
    return live


cdef inline void tg_free(PoolState* st, Upstream up, Block* b, StreamKey s) noexcept nogil:
    """Under the pool's lock: take back live tagged block b, last used on s. Streams added
    with record_stream are ordered by a device synchronize (tagged blocks keep no events):
    the block is then free for any stream of its tag; while s or one of them is being
    captured into a CUDA graph, the synchronize waits for the tag's next request outside a
    capture (tg_reorder). A sleeping block's bytes leave the
    asleep count (its pages are not mapped: nothing becomes cached) and the offloaded one;
    the last live block of a sleeping segment gives its host copy back (core/offload.pxd)."""
    cdef size_t size = b.size
    cdef Counters* c = &st.counters
    cdef Segment* seg = b.segment
    if hist_on(st.segments.recording[0]):
        hist_free(st.segments.device, st.segments.pool_id, b.ptr, size, s.handle)
    b.holder = NULL
    b.stream = s
    if b.extra_streams != NULL:
        if tg_captured(up, s, b.extra_streams, &st.tag_waits):
            # A synchronize would invalidate the capture: the block waits for one made once
            # the capture is over (tg_reorder); unordered, no request takes it until then.
            b.stream = unordered()
        elif up.synchronize() == 0:
            b.stream = stream_key(NO_STREAM, BY_HANDLE)
        else:
            up.clear_error()            # ordered on s alone: the block stays s's
        del b.extra_streams
        b.extra_streams = NULL
    b.used = c.num_allocs
    b.state = TAGGED
    if seg.asleep:
        c.asleep -= size
        c.num_frees += 1
        c.freed_bytes += size
        if seg.offload.ptr:
            c.offloaded -= size
    else:
        count_freed(c, size)
        st.bound -= size
    if tg_joins(b, b.seg_prev):
        b = b.seg_prev
        tg_join(st, b, b.seg_next)
    if tg_joins(b, b.seg_next):
        tg_join(st, b, b.seg_next)
    if seg.offload.ptr and tg_live_bytes(seg) == 0:
        of_free(up, &seg.offload, c)        # nothing left to restore at wake


cdef inline void tg_sleep_counts(PoolState* st, Segment* seg, bint sleep) noexcept nogil:
    """Move the counters of seg's blocks as its pages are unmapped (sleep) or mapped again
    (not sleep; sg_map has counted the pages reserved and cached): live bytes between in use
    and asleep, free bytes out of (or into) cached; live bytes into (or out of) offloaded
    where seg holds its host copy (seg.offload)."""
    cdef Counters* c = &st.counters
    cdef size_t live = tg_live_bytes(seg)
    if seg.offload.ptr:
        if sleep:
            c.offloaded += live
        else:
            c.offloaded -= live
    if sleep:
        c.reserved -= seg.nbytes
        c.cached -= seg.nbytes - live
        c.in_use -= live
        c.asleep += live
        c.upstream_frees += 1
        st.bound -= live
    else:
        c.cached -= live
        add_with_peak(&c.in_use, &c.peak_in_use, live)
        c.asleep -= live
        st.bound += live
        if st.bound > c.peak_in_use:
            mp_settle_peak(st)
