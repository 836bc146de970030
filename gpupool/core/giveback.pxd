# Giving memory back (core/segments.pxd has the overview): unmapping free pages of expandable
# segments, trims, stream merges, and the pool's end. Under the pool's lock.
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free
from libcpp.algorithm cimport sort
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, Segment, FREE, UNMAPPED
from gpupool.records.counters cimport Counters, count_returned
from gpupool.records.ipcslot cimport gp_ipc_opened, gp_ipc_retire
from gpupool.history.ring cimport ACT_SEGMENT_FREE, ACT_SEGMENT_UNMAP
from gpupool.core.cutjoin cimport sg_record, sg_retire, sg_insert_after, sg_remove, sg_joinable, sg_join
from gpupool.core.freelist cimport FreeLists, fl_put, fl_each, fl_unbin
from gpupool.core.segments cimport round_up, sg_note, sg_drop_segment
from gpupool.core.state cimport PoolState, Segments, StreamOrder
from gpupool.core.streamorder cimport so_drop_events, so_done, so_unbind_all
from gpupool.records.streams cimport StreamKey, is_no_stream
from gpupool.upstream.base cimport Upstream
from gpupool.driver.status cimport GP_PY_ERROR

# What the upstream refused during a trim (sg_trim): the memory stays cached and counted, and a
# later trim tries again; Pool.trim warns of it.
cdef struct Refused:
    size_t calls                # frees, unmaps and synchronizes the upstream refused
    size_t nbytes               # the bytes they left cached
    int code                    # the last one's status code: its error stays pending
    const char* what            # the last one's call: "free", "unmap" or "synchronize"


cdef inline void sg_refused(Upstream up, Refused* refused, int code, const char* what,
                            size_t nbytes) noexcept nogil:
    """A call of a trim the upstream refused: with a record (refused), counted there and its
    error left pending for the caller to take (a later refusal's replaces it); else cleared."""
    if refused == NULL:
        up.clear_error()
        return
    refused.calls += 1
    refused.nbytes += nbytes
    refused.code = code
    refused.what = what


cdef inline str sg_refused_text(PoolState* st, Upstream up, Refused* refused):
    """What a trim's upstream refused, as Pool.trim's warning says it (its pending error
    taken); None: nothing."""
    if refused.calls == 0:
        return None
    if refused.code == GP_PY_ERROR and up.pending_error is None:
        cause = "its exception was not kept"
    else:
        try:
            up.raise_error(refused.code, refused.what.decode())
            cause = f"status {refused.code}"
        except Exception as exc:        # (as text: its traceback's frames let go)
            cause = f"{type(exc).__name__}: {exc}"
    head = f"Pool.trim on device {st.segments.device}: "
    if refused.what == b"synchronize":
        return (f"{head}the device synchronize before it failed ({cause}), so nothing was "
                f"given back; {st.counters.cached} B stay cached, and a later trim() tries "
                f"again")
    return (f"{head}the upstream refused {refused.calls} call"
            f"{'s' if refused.calls > 1 else ''} to give memory back (the last, "
            f"{refused.what.decode()}: {cause}); {refused.nbytes} B stay cached and "
            f"reserved, and a later trim() tries again")


cdef inline bint sg_imported(Segment* seg) noexcept nogil:
    """Whether another process holds seg open through CUDA IPC (its export slot's count of
    importers' mappings, in shared memory): it must not go back to the driver yet."""
    return seg.ipc != NULL and gp_ipc_opened(seg.ipc) > 0


cdef inline void sg_forget_export(Segment* seg) noexcept nogil:
    """seg goes back to the driver: a handle of it can no longer be opened."""
    if seg.ipc != NULL:
        gp_ipc_retire(seg.ipc)
        seg.ipc = NULL


cdef inline size_t sg_unmap_free(PoolState* st, Upstream up, Block* b,
                                 Refused* refused) noexcept nogil:
    """Unmap the whole pages of free block b of an expandable segment (its work is done):
    pages at the segment's end shrink it, others become an unmapped hole; the partial pages
    around them stay free. Returns the bytes unmapped; a refused unmap goes to refused
    (sg_refused)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef FreeLists* fl = &st.free
    cdef Segment* seg = b.segment
    cdef size_t g = up.granularity
    # Pages are counted from the segment's start (a range is aligned to the page there).
    cdef uintptr_t lo = seg.base + round_up(b.ptr - seg.base, g)
    cdef uintptr_t hi = seg.base + (b.ptr + b.size - seg.base) // g * g
    cdef Block* hole
    cdef Block* rest
    cdef int r
    if hi <= lo:
        fl_put(fl, b)
        return 0
    r = up.unmap(lo, hi - lo)
    if r != 0:
        sg_refused(up, refused, r, "unmap", hi - lo)     # the pages stay mapped and cached
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
        sg_retire(st, hole)
        hole = b
    if hole.seg_next != NULL and hole.seg_next.state == UNMAPPED:
        b = hole.seg_next
        hole.size += b.size
        sg_remove(b)
        sg_retire(st, b)
    if hole.seg_next == NULL:           # the segment's end: it shrinks
        seg.nbytes = hole.ptr - seg.base
        sg_remove(hole)
        sg_retire(st, hole)
        if seg.first == NULL:
            if up.unreserve(seg.base) != 0:
                up.clear_error()        # the range stays reserved: address space, no memory
            sg_drop_segment(sg, seg)
    return hi - lo


cdef inline void sg_rejoin(PoolState* st, vector[Block*]* blocks,
                           vector[Block*]* runs) noexcept nogil:
    """After every event has completed, with blocks (all free, out of the free lists, free for
    any stream): join each run of joinable neighbours into its first; the runs go to runs.
    In address order, each block joins the run just below it or starts one: joining is not
    transitive (a region's free block takes in the pool's, which another region's may also
    border: the two regions' stay apart), so a block whose lower neighbour could take it
    may still find that run closed to it, and must then start its own (it would otherwise be
    left out of the free lists)."""
    cdef vector[pair[uintptr_t, size_t]] order    # (address, index in blocks)
    cdef size_t i
    cdef Block* b
    for i in range(blocks.size()):
        order.push_back(pair[uintptr_t, size_t](blocks[0][i].ptr, i))
    sort(order.begin(), order.end())    # (addresses are distinct)
    for i in range(order.size()):
        b = blocks[0][order[i].second]
        if b.state != FREE:
            continue                    # joined into the run below it (and retired)
        runs.push_back(b)
        while b.seg_next != NULL and sg_joinable(b, b.seg_next):
            sg_join(st, b, b.seg_next)


cdef inline bint sg_free_segment(PoolState* st, Upstream up, Block* b,
                                 Refused* refused) noexcept nogil:
    """Give b's plain segment, of which b (out of the free lists, its work done) is the one
    block, back to the upstream. False: the upstream's free failed, so the memory is still
    the pool's (a failed cuMemFree frees nothing), and b, out of the free lists, goes back
    there by the caller: it stays cached, and a later trim tries again. Its export is
    forgotten all the same (a new one is made should it be shared again). A refusal goes to
    refused (sg_refused)."""
    cdef Segments* sg = &st.segments
    cdef Segment* seg = b.segment
    cdef int r
    sg_forget_export(seg)               # first: no importer may open it while it goes
    r = up.free(seg.base)
    if r != 0:
        sg_refused(up, refused, r, "free", seg.nbytes)
        return False
    count_returned(&st.counters, seg.nbytes)
    sg_note(sg, ACT_SEGMENT_FREE, seg.base, seg.nbytes, seg.stream)
    sg_drop_segment(sg, seg)
    sg_retire(st, b)
    return True


cdef inline size_t sg_shed(PoolState* st, Upstream up, size_t size, StreamKey s) noexcept nogil:
    """Before a plain upstream grows for a request of size bytes on s: give back the pool's
    wholly free plain segments smaller than size (none of them can serve it) whose work is
    known done (so_done), without a synchronize. A segment whose work is not known done yet
    stays, and gets an event for the next look (on s at once; on another stream when that
    stream next allocates): its memory goes back only once the work queued on it before its
    free has completed, so the upstream's free needs no stream (the async upstream frees on
    the legacy stream, which a created stream's queued work does not precede). Regions'
    cached segments and segments another process holds open stay. Returns the bytes given
    back."""
    cdef Segment* seg = st.segments.head
    cdef Segment* nxt
    cdef Block* b
    cdef size_t before = st.counters.reserved
    while seg != NULL:
        nxt = seg.next
        b = seg.first
        if not seg.va_bytes and seg.nbytes < size and b == seg.last and b.state == FREE and \
                b.region.cache == NULL and not sg_imported(seg) and \
                so_done(&st.order, up, b, s) and fl_unbin(&st.free, b) and \
                not sg_free_segment(st, up, b, NULL):
            fl_put(&st.free, b)
        seg = nxt
    return before - st.counters.reserved


cdef inline size_t sg_trim(PoolState* st, Upstream up, Refused* refused) noexcept nogil:
    """Give the pool's free memory back: wholly free plain segments to the upstream, whole
    free pages of expandable segments unmapped; blocks cached by regions stay. Synchronizes
    the device first when a cached block may still be read by queued work; what stays cached
    is then free for any stream. Returns the bytes given back; what the upstream refused
    stays cached and goes to refused (NULL: nowhere, its errors cleared)."""
    cdef Segments* sg = &st.segments
    cdef Counters* c = &st.counters
    cdef StreamOrder* so = &st.order
    cdef FreeLists* fl = &st.free
    cdef vector[Block*] blocks, runs
    cdef size_t i, before = c.reserved
    cdef Block* b
    cdef Segment* seg
    cdef bint busy = False
    cdef int r
    fl_each(fl, &blocks)
    for i in range(blocks.size()):
        busy = busy or not is_no_stream(blocks[i].stream)
    blocks.clear()
    if busy or (up.expandable and fl.nblocks):
        # Cached blocks may still be read by work queued before their free; never-used ones
        # have no work, but pages are unmapped only with the device idle (a mapping change
        # under running work is not worth the risk). After this every event has completed.
        r = up.synchronize()
        if r != 0:
            sg_refused(up, refused, r, "synchronize", 0)
            return 0                    # the work may not be done: nothing is safe to free
        so.wanted.clear()
    so_unbind_all(st, &blocks, NULL)
    sg_rejoin(st, &blocks, &runs)
    for i in range(runs.size()):
        b = runs[i]
        seg = b.segment
        if b.region.cache != NULL:
            fl_put(fl, b)
        elif seg.va_bytes:
            sg_unmap_free(st, up, b, refused)
        elif b.seg_prev == NULL and b.seg_next == NULL and not sg_imported(seg):
            if not sg_free_segment(st, up, b, refused):
                fl_put(fl, b)           # the free failed: it stays cached
        else:
            fl_put(fl, b)
    return before - c.reserved


cdef inline void sg_merge_streams(PoolState* st, size_t* moved) noexcept nogil:
    """After a device synchronize: every free block becomes free for any stream (neighbours
    freed on different streams join)."""
    cdef FreeLists* fl = &st.free
    cdef vector[Block*] blocks, runs
    cdef size_t i
    so_unbind_all(st, &blocks, moved)
    sg_rejoin(st, &blocks, &runs)
    for i in range(runs.size()):
        fl_put(fl, runs[i])


cdef inline void sg_release_all(PoolState* st, Upstream up) noexcept nogil:
    """At the pool's end (no block live): give every segment back, drop every record. What
    the upstream fails to give back stays with it (nothing is left to try again): a failed
    free's allocation, and the pages of a failed unmap with their range, which is then not
    unreserved (the driver frees no range with pages mapped in it)."""
    cdef Segments* sg = &st.segments
    cdef StreamOrder* so = &st.order
    cdef Segment* seg
    cdef Block *b, *nxt
    cdef uintptr_t start = 0
    cdef size_t i
    cdef bint unmapped
    while sg.head != NULL:
        seg = sg.head
        if seg.asleep:
            seg.nbytes = 0              # a sleeping tag's: no page is mapped
        b = seg.first
        start = seg.base
        unmapped = True
        while b != NULL:                # expandable: unmap each run of mapped pages
            nxt = b.seg_next
            if seg.va_bytes and b.state == UNMAPPED:
                if b.ptr > start:
                    unmapped = up.unmap(start, b.ptr - start) == 0 and unmapped
                    sg_note(sg, ACT_SEGMENT_UNMAP, start, b.ptr - start, seg.stream)
                start = b.ptr + b.size
            so_drop_events(so, b)
            free(b)
            b = nxt
        if seg.va_bytes:
            if seg.base + seg.nbytes > start:
                unmapped = up.unmap(start, seg.base + seg.nbytes - start) == 0 and unmapped
                sg_note(sg, ACT_SEGMENT_UNMAP, start, seg.base + seg.nbytes - start,
                        seg.stream)
            if unmapped:
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
