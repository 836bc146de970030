# Stream order: when a free block may serve a request on another stream than its last one.
#
# A block goes back to its own stream at once, and a free never calls the driver. Another
# stream takes it once an event recorded on the old stream after the free reports complete
# (cuEventQuery; such blocks are preferred) or after making the new stream wait for that event
# on the GPU (cuStreamWaitEvent): the allocation path never blocks the host. Events are
# recorded only on streams known to be alive: the legacy default stream and the calling
# thread's per-thread stream at once, any other stream the next time it allocates (a buffer
# may outlive its stream, and a destroyed stream must never be touched): such a stream is
# "wanted", and its free blocks get their events when it next allocates (answer_wanted).
# Blocks of streams that never come back are freed for all by a trim or merge_streams().
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool._block cimport Block, Slab
from gpupool._freelist cimport (
    FreeLists, StreamBin, fl_class, fl_front, fl_pop, fl_each_of, fl_take_all, fl_put,
)
from gpupool._streams cimport (
    StreamKey, STREAM_PER_THREAD, same_stream, is_no_stream, no_stream, current_thread,
)
from gpupool._upstream cimport Upstream

cdef enum:
    WANTED_MAX = 256            # streams asked for events before a synchronize frees them all

cdef cppclass StreamOrder:
    vector[uintptr_t] events    # recycled events (created on the pool's device)
    vector[StreamKey] wanted    # streams whose free blocks another stream waits for


cdef inline uintptr_t so_event(StreamOrder* so, Upstream up) noexcept nogil:
    """A recycled or new event; 0 when none could be created."""
    cdef uintptr_t e = 0
    if not so.events.empty():
        e = so.events.back()
        so.events.pop_back()
    elif up.event_create(&e) != 0:
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


cdef inline bint so_after(Upstream up, uintptr_t event, StreamKey s, bint wait) noexcept nogil:
    """Whether work on s is ordered after event: it has completed, or (wait) s now waits for
    it on the GPU (cuStreamWaitEvent), which never blocks the host."""
    if up.event_query(event) == 0:
        return True
    return wait and up.stream_wait(s.handle, event) == 0


cdef inline void so_mark_stream(StreamOrder* so, StreamKey s) noexcept nogil:
    """Ask for events on stream s's free blocks the next time s allocates."""
    cdef size_t i
    for i in range(so.wanted.size()):
        if same_stream(so.wanted[i], s):
            return
    so.wanted.push_back(s)


cdef inline bint so_ready(StreamOrder* so, Upstream up, Block* b, StreamKey s,
                          bint wait) noexcept nogil:
    """Whether stream s may use b now: all work on b's earlier streams, submitted before its
    free, has completed or (wait) is ordered before s's next work."""
    cdef size_t i
    if not (same_stream(b.stream, s) or is_no_stream(b.stream)):
        if b.event == 0:
            # The legacy stream and this thread's per-thread stream always exist: record now.
            # Another stream may be gone; ask for an event when it next allocates.
            if not (b.stream.handle == 0 or (b.stream.handle == STREAM_PER_THREAD and
                                             b.stream.tag == current_thread())):
                so_mark_stream(so, b.stream)
                return False
            b.event = so_event(so, up)
            if b.event == 0:
                return False
            if up.event_record(b.event, b.stream.handle) != 0:
                so.events.push_back(b.event)
                b.event = 0
                return False
        if not so_after(up, b.event, s, wait):
            return False
    if b.extra_events != NULL:
        for i in range(b.extra_events.size()):
            if not so_after(up, b.extra_events[0][i], s, wait):
                return False
    so_drop_events(so, b)
    return True


cdef inline Block* so_take(StreamOrder* so, Upstream up, FreeLists* fl, int cls,
                           StreamKey s) noexcept nogil:
    """A free block of class cls in fl that stream s may use now, taken out of fl; NULL if
    none. This stream's blocks first (same addresses, no wait), then never-used ones, then
    other streams' blocks whose work has completed, then (GPU-side wait) the others."""
    cdef vector[StreamBin]* bins = fl_class(fl, cls)
    cdef size_t i, n, same, fresh
    cdef int wait
    cdef Block* b
    if bins == NULL:
        return NULL
    n = same = fresh = bins.size()
    # Fast path, the steady state of one stream: its bin first, its oldest block free of
    # other streams' events.
    if n and same_stream(bins[0][0].key, s) and not bins[0][0].heap.empty():
        b = fl_front(bins, 0)
        if b.extra_events == NULL:          # as so_ready(b, s) for its own stream
            so_drop_events(so, b)
            return fl_pop(bins, 0)
    for i in range(n):
        if bins[0][i].heap.empty():
            continue
        if same_stream(bins[0][i].key, s):
            same = i
        elif is_no_stream(bins[0][i].key):
            fresh = i
    if same < n and so_ready(so, up, fl_front(bins, same), s, True):
        return fl_pop(bins, same)
    if fresh < n:
        return fl_pop(bins, fresh)
    for wait in range(2):
        for i in range(n):
            if i != same and not bins[0][i].heap.empty() and \
                    so_ready(so, up, fl_front(bins, i), s, wait):
                return fl_pop(bins, i)
    return NULL


cdef inline void so_mark_blocks(StreamOrder* so, Upstream up, FreeLists* fl,
                                StreamKey s) noexcept nogil:
    """Record one event on stream s (alive: it is allocating) for its free blocks in fl."""
    cdef vector[Block*] blocks
    cdef size_t i
    cdef uintptr_t e = 0
    fl_each_of(fl, s, &blocks)
    for i in range(blocks.size()):
        if blocks[i].event == 0:
            e = so_event(so, up)
            if e == 0 or up.event_record(e, s.handle) != 0:
                if e:
                    so.events.push_back(e)
                return
            blocks[i].event = e


cdef inline bint so_is_wanted(StreamOrder* so, StreamKey s) noexcept nogil:
    """Whether s was wanted; it no longer is (its blocks are now to be marked)."""
    cdef size_t i
    for i in range(so.wanted.size()):
        if same_stream(so.wanted[i], s):
            so.wanted.erase(so.wanted.begin() + i)
            return True
    return False


cdef inline int so_slab_event(StreamOrder* so, Upstream up, Slab* slab) noexcept nogil:
    """Record an event on the stream a slab was allocated on (stream-ordered upstreams: the
    memory exists in that stream's order only); synchronize when no event can be had."""
    cdef uintptr_t e = so_event(so, up)
    cdef int r
    if e == 0:
        return up.synchronize()
    r = up.event_record(e, slab.stream.handle)
    if r != 0:
        so.events.push_back(e)
        return r
    slab.event = e
    return 0


cdef inline void so_rebin_unused(StreamOrder* so, FreeLists* fl, vector[Block*]* blocks,
                                 size_t* moved) noexcept nogil:
    """After a device synchronize: put blocks into fl as free for any stream (their events
    recycled); counts in moved those that were bound to a stream."""
    cdef size_t i
    cdef Block* b
    for i in range(blocks.size()):
        b = blocks[0][i]
        if moved != NULL and not is_no_stream(b.stream):
            moved[0] += 1
        so_drop_events(so, b)
        b.stream = no_stream()
        fl_put(fl, b)


cdef inline void so_merge(StreamOrder* so, FreeLists* fl, size_t* moved) noexcept nogil:
    """After a device synchronize: every block of fl becomes free for any stream."""
    cdef vector[Block*] blocks
    fl_take_all(fl, &blocks)
    so_rebin_unused(so, fl, &blocks, moved)
