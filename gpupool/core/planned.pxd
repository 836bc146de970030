# A planned region's requests in the core (Note [Planned regions] in docs/design.md): request k
# of an entry takes its planned place, the bytes [base + offsets[k], + its size), when they are
# free in the pool now (the pool's or the region's own free memory, in one free block) and the
# request's stream may use them; otherwise it takes the online path. The plan holds no memory
# of its own: its places are addresses in the pool's segment where the region's own step
# already lies, around the blocks that stay there (pl_layout), so a planned step takes memory
# the online one would.
# Under the pool's lock; only core/acquire.pxd (the take) and core/pool.pyx (the window) use it.
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t, int64_t, INT64_MAX
from libcpp.algorithm cimport sort
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, Segment, FREE, LIVE, PARKED
from gpupool.records.streams cimport StreamKey, same_stream, is_no_stream
from gpupool.core.cutjoin cimport sg_split, sg_cut_front
from gpupool.core.freelist cimport fl_unbin
from gpupool.core.growexpand cimport sg_extends, sg_map_end
from gpupool.core.parking cimport pk_flush, pk_flush_range, pk_unpark_block
from gpupool.core.plantable cimport (
    PlanTable, PlanEvent, PlanHint, PlanCall, PL_ENTRY, PL_READ, PL_LAYOUT, PL_INSTALL, PL_RECORD,
    PL_OVER, pt_clear, pt_served, pt_log, pt_unmatch,
)
from gpupool.core.regioncache cimport RegionCache, rc_disown
from gpupool.core.segments cimport BLOCK_ALIGN, round_up
from gpupool.core.state cimport PoolState
from gpupool.core.streamorder cimport so_ready, so_drop_events
from gpupool.upstream.base cimport Upstream


cdef inline Block* pl_block_at(PoolState* st, PlanTable* p, size_t k,
                               uintptr_t addr) noexcept nogil:
    """The block holding address addr (request k's place), walked to from the higher of
    request k's anchor (a live planned block just below its place) and its hint (the last of
    the blocks that stay just below it, p.hints: the anchor may lie below many of them), else
    from the start of the segment holding addr; NULL if no segment holds it."""
    cdef Block* b = NULL
    cdef Segment* seg
    cdef int64_t a = p.anchors[k]
    cdef PlanHint* h = &p.hints[k]
    if a >= 0 and p.live[a] != NULL and p.live[a].ptr <= addr:
        b = p.live[a]
    if h.block != NULL and h.block.state == LIVE and h.block.ptr == h.ptr and \
            (b == NULL or b.ptr < h.ptr):
        b = h.block                 # (a retired record is RETIRED, never LIVE)
    if b == NULL:
        seg = st.segments.head
        while seg != NULL and not (seg.base <= addr < seg.base + seg.nbytes):
            seg = seg.next
        if seg == NULL:
            return NULL
        b = seg.first
    while b != NULL and b.ptr + b.size <= addr:
        b = b.seg_next
    return b


cdef inline void pl_hints(PoolState* st, PlanTable* p) noexcept nogil:
    """Each request's hint (p.hints) for the plan just installed: the last block of the run of
    live blocks that are not planned ones just below its place in the plan's segment now."""
    cdef Segment* seg = st.segments.head
    cdef vector[PlanHint] ends
    cdef PlanHint h
    cdef Block* b
    cdef size_t k, lo, hi, mid
    cdef uintptr_t addr
    h.block = NULL
    h.ptr = 0
    p.hints.assign(p.offsets.size(), h)
    while seg != NULL and seg.base != p.base:
        seg = seg.next
    if seg == NULL:
        return
    b = seg.first
    while b != NULL:
        if b.state == LIVE and not b.region.place and \
                (b.seg_next == NULL or b.seg_next.state != LIVE or b.seg_next.region.place):
            h.block = b
            h.ptr = b.ptr
            ends.push_back(h)
        b = b.seg_next
    for k in range(p.offsets.size()):
        if p.offsets[k] < 0:
            continue
        addr = p.base + <uintptr_t>p.offsets[k]
        lo, hi = 0, ends.size()         # the first run end above addr
        while lo < hi:
            mid = (lo + hi) >> 1
            if ends[mid].ptr <= addr:
                lo = mid + 1
            else:
                hi = mid
        if lo:
            p.hints[k] = ends[lo - 1]


cdef inline void pl_record(RegionCache* rc, size_t nbytes) noexcept nogil:
    """Request 0 of nbytes starts a record step: the rest of the entry goes online until its
    plan is installed, and the allocation's slow path (rc.on_alloc, swapped with
    rc.on_record until PL_RECORD or the next entry) makes that plan."""
    cdef PlanTable* p = rc.plan
    cdef PyObject* hook = rc.on_record
    p.record_nbytes = nbytes
    p.stopped = True
    rc.on_record = rc.on_alloc
    rc.on_alloc = hook


cdef inline void pl_unrecord(RegionCache* rc) noexcept nogil:
    """The record step's plan is no longer pending: the slow paths are swapped back."""
    cdef PyObject* hook = rc.on_alloc
    if rc.plan.record_nbytes:
        rc.plan.record_nbytes = 0
        rc.on_alloc = rc.on_record
        rc.on_record = hook


cdef inline bint pl_started_record(PlanTable* p) noexcept nogil:
    """After pl_take: whether the request it took in was request 0 and started a record step
    (pl_record), for a caller that hands such a request back (PW_HAND_BACK)."""
    return p.next == 1 and p.record_nbytes != 0


cdef inline bint pl_at_record(PlanTable* p) noexcept nogil:
    """Whether the entry's only event since its start (but the tails' frees before it) is
    its request 0: a record step's plan is made then, and installed only if still so."""
    return p.next == 1 and p.active and p.event == <size_t>p.allocs[0] + 1


cdef inline bint pl_grow(PoolState* st, Upstream up, RegionCache* rc, uintptr_t end,
                         StreamKey s) noexcept nogil:
    """A growing plan's place ends at end, past the mapped end of the plan's segment: map
    its pages up to end (an expandable segment of s's, joined with its free last block when
    rc may take it). Whether they were mapped; a failure leaves the request to the online
    path, which grows or raises as it does for any request."""
    cdef Segment* seg = st.segments.head
    cdef size_t need
    cdef Block* tail
    while seg != NULL and seg.base != rc.plan.base:
        seg = seg.next
    if seg == NULL or not seg.va_bytes or not same_stream(seg.stream, s) or \
            end <= seg.base + seg.nbytes:
        return False
    need = round_up(end - seg.base - seg.nbytes, up.granularity)
    if seg.nbytes + need > seg.va_bytes:
        return False
    tail = seg.last if sg_extends(seg.last, s, <void*>rc) else NULL
    if sg_map_end(st, up, seg, need, s, tail, <void*>rc) != 0:
        up.clear_error()
        return False
    return True


cdef inline Block* pl_cut(PoolState* st, Block* b, uintptr_t addr, size_t size,
                          StreamKey s) noexcept nogil:
    """Free block b, which holds [addr, addr + size), taken for a planned request on s (its
    stream order checked): out of the free lists and its cache, cut to those bytes (the
    front and the rest stay free, its owner's), used on s; NULL when the front could not be
    cut (pl_take's place, pl_refit's gap)."""
    cdef RegionCache* owner
    fl_unbin(&st.free, b)
    owner = rc_disown(b)
    if not same_stream(b.stream, s):
        so_drop_events(&st.order, b)    # its earlier work is ordered before s's next
    if b.ptr < addr:
        b = sg_cut_front(st, b, addr, s, owner)
        if b == NULL:
            return NULL
    sg_split(st, b, size, s, owner)
    b.stream = s
    return b


cdef enum:
    REFIT_HITS = 2      # the hits an entry has had before a request past its place is refitted


cdef inline Block* pl_refit(PoolState* st, Upstream up, RegionCache* rc, size_t k,
                            size_t size, StreamKey s) noexcept nogil:
    """Request k of size bytes (rounded), larger than its place, on s: a block at the lowest
    address of the plan's segment whose bytes are free now and meet no place of a request
    live with k by the plan's events (those after k allocated before k's free, the next
    entry's allocated before it), cut and out of the free lists as pl_take's (a free block
    of s's or of none, no record_stream events, the pool's or rc's); NULL when none holds it.
    It maps no pages. The entry stays on the plan: its later requests find their places
    free (Note [Requests past their place])."""
    cdef PlanTable* p = rc.plan
    cdef Segment* seg = st.segments.head
    cdef vector[pair[int64_t, int64_t]] met         # (offset, end) of those places, joined
    cdef int64_t end = p.frees[k] if p.frees[k] >= 0 else INT64_MAX
    cdef int64_t lo, hi, at = -1
    cdef Block* b
    cdef size_t j, i = 0
    while seg != NULL and seg.base != p.base:
        seg = seg.next
    if seg == NULL:
        return NULL
    for j in range(p.offsets.size()):
        if p.offsets[j] >= 0 and ((j > k and p.allocs[j] < end) or
                                  (j < k and p.allocs[j] + p.length < end)):
            met.push_back(pair[int64_t, int64_t](p.offsets[j], p.offsets[j] + p.sizes[j]))
    sort(met.begin(), met.end())
    for j in range(1, met.size()):
        if met[j].first <= met[i].second:
            met[i].second = max(met[i].second, met[j].second)
        else:
            i += 1
            met[i] = met[j]
    met.resize(i + 1 if met.size() else 0)
    if st.nparked:
        pk_flush(st)                # bytes parked unjoined join their free neighbours
    i = 0
    b = seg.first
    while b != NULL:
        if b.state == FREE and b.size >= size and b.extra_events == NULL and \
                (b.region.cache == NULL or b.region.cache == <void*>rc) and \
                (same_stream(b.stream, s) or is_no_stream(b.stream)):
            lo = <int64_t>(b.ptr - seg.base)
            hi = lo + <int64_t>b.size
            while i < met.size() and met[i].second <= lo:
                i += 1
            j = i           # the gaps of [lo, hi) between the places met, lowest first
            while lo + <int64_t>size <= hi:
                if j >= met.size() or met[j].first >= lo + <int64_t>size:
                    at = lo
                    break
                lo = max(lo, <int64_t>round_up(<size_t>met[j].second, BLOCK_ALIGN))
                j += 1
            if at >= 0:
                break
        b = b.seg_next
    if b == NULL or not so_ready(&st.order, up, b, s, True):
        return NULL
    return pl_cut(st, b, seg.base + <uintptr_t>at, size, s)


cdef inline Block* pl_take(PoolState* st, Upstream up, RegionCache* rc, size_t nbytes,
                           size_t size, StreamKey s) noexcept nogil:
    """Request number rc.plan.next of the entry, of nbytes requested (size rounded) on s:
    its block cut at its planned place and out of the free lists (the caller links it,
    live), or NULL (no plan for it, or its bytes are not free now: the online path serves
    it). A request on another stream than the planned one, at another event of the entry or
    larger than its place, or request 0 asking fewer bytes than first_under, is off the
    plan's step: it and the rest of the entry go the online way (under a lenient plan a
    larger request goes alone). Request 0 asking more than record_over starts a record step:
    it goes online, and so does the rest until the region's slow path installs the step's
    own plan (pl_record). Stream order as so_take's: another stream's free bytes are
    taken once that stream's work on them has completed, or after s waits for it on the
    GPU."""
    cdef PlanTable* p = rc.plan
    cdef size_t k = p.next
    cdef uintptr_t addr
    cdef Block* b
    p.next += 1
    if k == 0:
        p.first_nbytes = nbytes
    if not p.active or p.stopped or k >= p.offsets.size():
        return NULL
    if p.allocs[k] != <int64_t>p.event or s.handle != p.streams[k]:
        p.misses += 1
        p.stopped = True
        return NULL
    if k == 0:
        if nbytes < p.first_under:
            p.misses += 1
            p.stopped = True
            return NULL
        if p.record_over and nbytes > p.record_over and rc.on_record != NULL:
            pl_record(rc, nbytes)
            return NULL
    if p.offsets[k] >= 0 and <int64_t>size > p.sizes[k]:
        p.misses += 1
        if p.hits >= REFIT_HITS and 0 <= p.refit_from <= <int64_t>k:
            b = pl_refit(st, up, rc, k, size, s)
            if b != NULL:
                return b
        p.stopped = not p.lenient
        return NULL
    if p.offsets[k] < 0:
        return NULL
    addr = p.base + <uintptr_t>p.offsets[k]
    b = pl_block_at(st, p, k, addr)
    if b != NULL and b.state == PARKED and b.ptr == addr and \
            pk_unpark_block(st, b, size, s, rc):
        # Freed last, held aside unjoined, and the place itself: taken as it is.
        return pt_served(p, k, b)
    if b != NULL and st.nparked and (b.state == PARKED or (
            b.state == FREE and addr + size > b.ptr + b.size)) and \
            pk_flush_range(st, addr, addr + size):
        # The place holds bytes parked unjoined (blocks freed last): those are put back
        # joined (it may span several), and its block found again.
        b = pl_block_at(st, p, k, addr)
    if p.grows and (b == NULL or (b.seg_next == NULL and b.state == FREE and
                                  addr + size > b.ptr + b.size)) and \
            pl_grow(st, up, rc, addr + size, s):
        b = pl_block_at(st, p, k, addr)
    # A front cut off a block with record_stream events would go back free without them
    # (the place takes them): such a place goes online.
    if b == NULL or b.state != FREE or addr + size > b.ptr + b.size or \
            not (b.region.cache == NULL or b.region.cache == <void*>rc) or \
            (b.extra_events != NULL and b.ptr < addr) or \
            not so_ready(&st.order, up, b, s, True):
        p.misses += 1
        return NULL
    b = pl_cut(st, b, addr, size, s)
    if b == NULL:
        p.misses += 1
        return NULL
    return pt_served(p, k, b)


cdef inline bint pl_movable(RegionCache* rc, Block* b, size_t since) noexcept nogil:
    """Whether b's bytes may take a new plan's places: free (the pool's or rc's), or live and
    allocated by rc's entry since (at an exit the entry that just ended, at a record step's
    request 0 the entry before: their tails, freed in the entry the plan serves, which the
    planner places by their lifetimes). Unmapped bytes (an expandable segment's hole) may
    not."""
    if b.state == LIVE:
        return b.region.cache == <void*>rc and b.region.stamp == since
    if b.state == FREE or b.state == PARKED:
        return b.region.cache == NULL or b.region.cache == <void*>rc
    return False


cdef inline uintptr_t pl_layout(PoolState* st, RegionCache* rc, PlanTable* io,
                                size_t since) noexcept nogil:
    """Where a new plan goes: the segment holding most of rc's bytes (cached and live). Its
    base goes to io.base, its bytes of memory (an expandable one's mapped from its base on)
    to io.nbytes, and each run of its blocks that are not pl_movable (the obstacles a plan
    places around) to io.events as (offset from the base, bytes, 0). Returns the base; 0
    when rc holds no bytes in any segment."""
    cdef Segment* seg = st.segments.head
    cdef Segment* best = NULL
    cdef Block* b
    cdef size_t mine, most = 0
    cdef PlanEvent e
    while seg != NULL:
        mine = 0
        b = seg.first
        while b != NULL:
            if b.region.cache == <void*>rc:
                mine += b.size
            b = b.seg_next
        if mine > most:
            best, most = seg, mine
        seg = seg.next
    io.events.clear()
    if best == NULL:
        return 0
    io.base = best.base
    io.nbytes = best.nbytes
    e.stream = 0
    e.nbytes = 0
    b = best.first
    while b != NULL:
        if not pl_movable(rc, b, since):
            if e.nbytes and e.ptr + e.nbytes == b.ptr - best.base:
                e.nbytes += b.size
            else:
                if e.nbytes:
                    io.events.push_back(e)
                e.ptr, e.nbytes = b.ptr - best.base, b.size
        b = b.seg_next
    if e.nbytes:
        io.events.push_back(e)
    return best.base


cdef inline uintptr_t pl_call(PoolState* st, RegionCache* rc, PlanCall op,
                              PlanTable* io) noexcept nogil:
    """The region's calls on its table (core/plantable.pxd's PlanCall), exchanging with io.
    PL_LAYOUT returns pl_layout's base; PL_RECORD the pending record step's layout's base and
    its request 0's bytes in io.record_nbytes (0 and 0: none pending); PL_INSTALL installs io's
    plan at io.base (with io.lenient, io.grows, io.record_over and io.first_under; during an
    entry, its next requests are served from it) and returns its base; a lenient one (a
    record step's plan) only if no event of the entry came since its PL_RECORD, and none
    while rc is shared (core/turns.pxd), else 0.
    PL_READ (at exit) hands io the events recorded since the last PL_READ, its hits and
    misses; io.same in: the caller holds the last read's events; out: they were the same,
    and io.events is left as it was (the caller's, empty). PL_READ and PL_ENTRY drop a
    record step's plan pending."""
    cdef PlanTable* p = rc.plan
    cdef bint same
    if op == PL_ENTRY:
        pl_unrecord(rc)
        p.record_event = 0
        pt_log(p, 0, 0, 0)          # the entry's marker
        p.next = p.hits = p.misses = p.event = p.first_nbytes = 0
        p.stopped = False
    elif op == PL_READ:
        pl_unrecord(rc)             # the entry is over: a record step's plan pending is not
        p.record_event = 0          # made, nor installed
        # A step that repeats (a planned entry served as the last) records the same events,
        # matched as they came (pt_log): they need not be copied out (Note [Step time of
        # planned regions]). Once one differed, or the read before's had fewer, they are not.
        same = p.matching and p.matched == p.last.size()
        if not same:
            pt_unmatch(p)
            p.last.swap(p.events)
        p.events.clear()
        p.matching, p.matched, p.nlast = True, 0, p.last.size()
        io.same = io.same and same
        if not io.same:
            io.events = p.last
        io.hits, io.misses, io.stopped = p.hits, p.misses, p.stopped
        io.first_nbytes = p.first_nbytes
    elif op == PL_LAYOUT:
        return pl_layout(st, rc, io, rc.entries)
    elif op == PL_RECORD:
        # Planned only right after request 0 (no event of the entry since: a request or a
        # free of another thread of the region leaves the entry online).
        io.record_nbytes = p.record_nbytes if pl_at_record(p) else 0
        pl_unrecord(rc)
        if not io.record_nbytes:
            return 0
        p.record_event = p.event
        return pl_layout(st, rc, io, rc.entries - 1)
    elif op == PL_OVER:
        p.record_over = io.record_over if p.active else 0
        p.first_under = io.first_under if p.active else 0
        p.refit_from = io.refit_from if p.active else -1
    elif op == PL_INSTALL:
        if rc.shared:
            return 0            # another thread's region took a turn since (core/turns.pxd)
        if io.lenient and not (p.record_event == p.event and pl_at_record(p)):
            p.record_event = 0
            return 0            # an event of the entry came while its record plan was made
        pt_clear(p)
        p.base = io.base
        p.offsets.swap(io.offsets)
        p.sizes.swap(io.sizes)
        p.streams.swap(io.streams)
        p.anchors.swap(io.anchors)
        p.allocs.swap(io.allocs)
        p.frees.swap(io.frees)
        p.length = io.length
        p.live.assign(p.offsets.size(), NULL)
        pl_hints(st, p)
        p.nbytes = io.nbytes
        p.lenient, p.grows, p.record_over = io.lenient, io.grows, io.record_over
        p.first_under = io.first_under
        p.refit_from = io.refit_from
        p.active = True
        if io.lenient:
            p.stopped = False       # a record step's plan: its entry goes on from it
        return p.base
    else:
        pt_clear(p)
    return 0
