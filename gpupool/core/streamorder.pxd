# Stream order: when a free block may serve a request on another stream than its last one.
#
# A block goes back to its own stream at once, and a free never calls the driver. Another
# stream takes it once an event recorded on the old stream after the free reports complete
# (cuEventQuery; such blocks are preferred) or after making the new stream wait for that event
# on the GPU (cuStreamWaitEvent): the allocation path never blocks the host. Events are
# recorded only on streams known to be alive: the legacy default stream and the calling
# thread's per-thread stream at once, any other stream the next time it allocates (a buffer
# may outlive its stream, and a destroyed stream must never be touched): such a stream is
# "wanted", and its free blocks get their events when it next allocates (so_clear_wanted, then
# so_mark_blocks).
# Blocks of streams that never come back are freed for all by a trim or merge_streams().
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, LIVE
from gpupool.core.freelist cimport (
    FreeLists, StreamBin, fl_before, fl_lower, fl_erase, fl_next_class, fl_each_of,
    fl_take_all,
)
from gpupool.core.regioncache cimport RegionCache, rc_lends
from gpupool.core.state cimport PoolState, StreamOrder
from gpupool.records.sizes cimport SMALL_REQUEST, floor_class
from gpupool.records.streams cimport (
    StreamKey, STREAM_PER_THREAD, NO_STREAM, BY_HANDLE, same_stream, is_no_stream, stream_key,
    current_thread,
)
from gpupool.upstream.base cimport Upstream

cdef enum:
    WANTED_MAX = 256            # streams asked for events before a synchronize frees them all
    SMALL_LOOKS = 64            # free blocks so_take_small looks at before it gives up


cdef inline uintptr_t so_event(StreamOrder* so, Upstream up) noexcept nogil:
    """A recycled or new event; 0 when none could be created."""
    cdef uintptr_t e = 0
    if not so.events.empty():
        e = so.events.back()
        so.events.pop_back()
    elif up.event_create(&e) != 0:
        up.clear_error()                # no event: the callers fall back
        return 0
    return e


cdef inline void so_drop_events(StreamOrder* so, Block* b) noexcept nogil:
    """Recycle the events of b (its work is ordered before its next user)."""
    cdef size_t i
    if b.event:
        so.events.push_back(b.event)
        b.event = 0
    if b.extra_events != NULL:
        for i in range(b.extra_events.size()):
            so.events.push_back(b.extra_events[0][i])
        del b.extra_events
        b.extra_events = NULL


cdef inline bint so_capturing(Upstream up, StreamKey s) noexcept nogil:
    """Whether work on s is being captured into a CUDA graph (cuStreamIsCapturing; a failed
    query counts as capturing): s then neither waits for an event recorded outside its
    capture nor has the device synchronized under it."""
    cdef bint capturing = True
    if up.stream_capturing(s.handle, &capturing) != 0:
        up.clear_error()
        return True
    return capturing


cdef inline bint so_after(Upstream up, uintptr_t event, StreamKey s, bint wait) noexcept nogil:
    """Whether work on s is ordered after event: it has completed, or (wait) s now waits for
    it on the GPU (cuStreamWaitEvent), which never blocks the host. Not for a stream being
    captured into a CUDA graph (so_ready asks first)."""
    if up.event_query(event) == 0:
        return True
    up.clear_error()                    # not complete, or the query failed: a wait may order it
    if wait and up.stream_wait(s.handle, event) == 0:
        return True
    up.clear_error()                    # not ordered (yet): the block is not taken
    return False


cdef inline void so_mark_wanted(StreamOrder* so, StreamKey s) noexcept nogil:
    """Ask for events on stream s's free blocks the next time s allocates."""
    cdef size_t i
    for i in range(so.wanted.size()):
        if same_stream(so.wanted[i], s):
            return
    so.wanted.push_back(s)


cdef inline bint so_record(StreamOrder* so, Upstream up, Block* b) noexcept nogil:
    """Record an event for free block b on its stream (known to be alive); whether one was
    recorded."""
    b.event = so_event(so, up)
    if b.event == 0:
        return False
    if up.event_record(b.event, b.stream.handle) != 0:
        so.events.push_back(b.event)
        b.event = 0
        up.clear_error()
        return False
    return True


cdef inline bint so_ready(StreamOrder* so, Upstream up, Block* b, StreamKey s,
                          bint wait) noexcept nogil:
    """Whether stream s may use b now: all work on b's earlier streams, submitted before its
    free, has completed or (wait) is ordered before s's next work. b keeps its events: a
    request looks at several blocks and so_take drops them for the one it takes. Never while
    s is being captured into a CUDA graph: an event query or record is refused during a
    capture (and invalidates it), and a wait for an event recorded outside the capture
    crosses its boundary (capture isolation), so a block of other streams' work is not
    taken then (Note [Capture in a planned region])."""
    cdef size_t i
    cdef bint others = not (same_stream(b.stream, s) or is_no_stream(b.stream))
    if (others or b.extra_events != NULL) and not is_no_stream(s) and so_capturing(up, s):
        return False
    if others:
        if b.event == 0:
            # The legacy stream and this thread's per-thread stream always exist: record now.
            # Another stream may be gone; ask for an event when it next allocates.
            if not (b.stream.handle == 0 or (b.stream.handle == STREAM_PER_THREAD and
                                             b.stream.tag == current_thread())):
                so_mark_wanted(so, b.stream)
                return False
            if not so_record(so, up, b):
                return False
        if not so_after(up, b.event, s, wait):
            return False
    if b.extra_events != NULL:
        for i in range(b.extra_events.size()):
            if not so_after(up, b.extra_events[0][i], s, wait):
                return False
    return True


cdef inline bint so_done(StreamOrder* so, Upstream up, Block* b, StreamKey s) noexcept nogil:
    """Whether the work on free block b submitted before its free has completed: it was never
    used (or freed for any stream), and each of its events reports complete (queried, never
    waited for: no stream's order stands for completion). A block with no event yet gets one
    for a later look: recorded now on s (the stream of the request asking, so alive) and
    where so_ready records, else when its stream next allocates (so_mark_wanted)."""
    if b.event == 0 and same_stream(b.stream, s) and not so_record(so, up, b):
        return False
    return so_ready(so, up, b, stream_key(NO_STREAM, BY_HANDLE), False)


cdef enum:
    MAY_USE = 0         # this stream's blocks and never-used ones
    READY = 1           # another stream's, whose work has completed
    WAITED = 2          # another stream's, after making this stream wait for it on the GPU


cdef inline bint so_allowed(Block* b, void* owner, bint borrow) noexcept nogil:
    """Whether a request served through cache owner (NULL: the pool) may take free block b:
    the pool's blocks and owner's own; with borrow, an idle region's too."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    return rc == NULL or <void*>rc == owner or (borrow and rc_lends(rc))


cdef inline Block* so_fit(StreamOrder* so, Upstream up, StreamBin* bin, size_t n, StreamKey s,
                          void* owner, bint borrow, int mode, size_t* index) noexcept nogil:
    """The smallest block of at least n bytes in bin that the request may take and stream s
    may use now (mode: MAY_USE, READY or WAITED); NULL if none. Its index goes to index."""
    cdef size_t i
    cdef Block* b
    for i in range(fl_lower(&bin.blocks, n), bin.blocks.size()):
        b = bin.blocks[i]
        if not so_allowed(b, owner, borrow):
            continue
        if (b.extra_events == NULL and mode == MAY_USE) or \
                so_ready(so, up, b, s, mode != READY):
            index[0] = i
            return b
        if mode != WAITED:
            return NULL                 # not ready: a later block of the bin is no readier
    return NULL


cdef inline Block* so_take(PoolState* st, Upstream up, size_t n, StreamKey s, void* owner,
                           bint borrow) noexcept nogil:
    """The best fit for n bytes in fl that stream s may use now, taken out of fl; NULL if
    none. Smallest block first (class by class); within a class this stream's blocks and
    never-used ones first (same addresses, no wait), then other streams' blocks whose work
    has completed, then (GPU-side wait) the others. Only blocks the request may take
    (so_allowed: owner's, the pool's, and with borrow idle regions')."""
    cdef StreamOrder* so = &st.order
    cdef FreeLists* fl = &st.free
    cdef int c = fl_next_class(fl, floor_class(n))
    cdef size_t i, j, found
    cdef StreamBin* bin
    cdef StreamBin* where
    cdef Block* b
    cdef Block* best
    cdef int mode
    while c >= 0:
        for mode in range(3):
            best = NULL
            for i in range(fl.bins[c].size()):
                bin = &fl.bins[c][i]
                if bin.blocks.empty() or \
                        (mode == MAY_USE) != (same_stream(bin.key, s) or is_no_stream(bin.key)):
                    continue
                b = so_fit(so, up, bin, n, s, owner, borrow, mode, &j)
                if b != NULL and (best == NULL or b.size < best.size):
                    best, where, found = b, bin, j
            if best != NULL:
                # Another stream's block: its earlier work is ordered before s's next. s's own
                # keeps its events for the rest that a cut leaves free (sg_split).
                if not same_stream(best.stream, s):
                    so_drop_events(so, best)
                fl_erase(fl, c, where, found)
                return best
        c = fl_next_class(fl, c + 1)
    return NULL


cdef inline bint so_under_small(Block* b) noexcept nogil:
    """Whether free block b lies just below a live small block in its segment."""
    cdef Block* n = b.seg_next
    return n != NULL and n.state == LIVE and n.size <= SMALL_REQUEST


cdef inline Block* so_take_small(PoolState* st, size_t n, StreamKey s,
                                 void* owner) noexcept nogil:
    """For a small request on an expandable upstream, a free block that s may use at once
    (its own or never-used, the pool's or owner's, no record_stream events), taken out of
    fl: the best fit when it holds at most three quarters more than n bytes (a hole of about
    the request's size: little is left), else the best fit among the blocks just below a live
    small block; NULL if neither (so_take then). Below a small block the request takes the
    top (sg_split_top), against it: small blocks stay together in runs that grow downward,
    out of the large free runs. Best fit alone put them in whatever hole fitted, between
    large blocks, where the long-lived ones (the optimizer's state, a bias's gradient) later
    split the free run a large request needed (ViT-B/16: a 132 MiB request grew the segment
    while 287 MiB were free, in pieces). It looks at the SMALL_LOOKS smallest blocks that fit
    at most (the recorded traces' requests looked at 6 or fewer on average, 42 at most), so a
    pool of many free blocks does not slow every small request."""
    cdef FreeLists* fl = &st.free
    cdef int c = fl_next_class(fl, floor_class(n))
    cdef size_t i, j, found = 0, fit_found = 0, looks = 0
    cdef StreamBin* bin
    cdef StreamBin* where = NULL
    cdef StreamBin* fit_where = NULL
    cdef Block* b
    cdef Block* best
    cdef Block* fit = NULL
    while c >= 0:
        best = NULL
        for i in range(fl.bins[c].size()):
            bin = &fl.bins[c][i]
            if not (same_stream(bin.key, s) or is_no_stream(bin.key)):
                continue
            for j in range(fl_lower(&bin.blocks, n), bin.blocks.size()):
                b = bin.blocks[j]
                if b.extra_events == NULL and so_allowed(b, owner, False):
                    if fit == NULL or (fit.cls == c and fl_before(b, fit)):
                        fit, fit_where, fit_found = b, bin, j
                    if so_under_small(b):
                        if best == NULL or fl_before(b, best):
                            best, where, found = b, bin, j
                        break           # the bin's smallest such block
                looks += 1
                if looks >= SMALL_LOOKS:
                    break
        if fit != NULL and 4 * fit.size <= 7 * n:
            best, where, found = fit, fit_where, fit_found
        if best != NULL:
            fl_erase(fl, best.cls, where, found)
            return best
        if looks >= SMALL_LOOKS:
            return NULL
        c = fl_next_class(fl, c + 1)
    return NULL


cdef inline void so_mark_blocks(PoolState* st, Upstream up, StreamKey s) noexcept nogil:
    """Record one event on stream s (alive: it is allocating) for its free blocks."""
    cdef StreamOrder* so = &st.order
    cdef vector[Block*] blocks
    cdef size_t i
    cdef uintptr_t e = 0
    fl_each_of(&st.free, s, &blocks)
    for i in range(blocks.size()):
        if blocks[i].event == 0:
            e = so_event(so, up)
            if e == 0 or up.event_record(e, s.handle) != 0:
                if e:
                    so.events.push_back(e)
                    up.clear_error()
                return
            blocks[i].event = e


cdef inline bint so_clear_wanted(StreamOrder* so, StreamKey s) noexcept nogil:
    """Take s off the wanted streams; whether it was on them (its blocks are then to be
    marked: so_mark_blocks)."""
    cdef size_t i
    for i in range(so.wanted.size()):
        if same_stream(so.wanted[i], s):
            so.wanted.erase(so.wanted.begin() + i)
            return True
    return False


cdef inline void so_unbind_all(PoolState* st, vector[Block*]* out, size_t* moved) noexcept nogil:
    """After a device synchronize (every event has completed): take every block out of the
    free lists into out, free for any stream now (events recycled); counts in moved (unless
    NULL) those that were bound to a stream."""
    cdef size_t i
    cdef Block* b
    fl_take_all(&st.free, out)
    for i in range(out.size()):
        b = out[0][i]
        if moved != NULL and not is_no_stream(b.stream):
            moved[0] += 1
        so_drop_events(&st.order, b)
        b.stream = stream_key(NO_STREAM, BY_HANDLE)
