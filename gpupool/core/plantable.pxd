# A planned region's table (Note [Planned regions] in docs/design.md; region/planned.py decides
# what goes in it): the requests and frees its entries make, recorded in order, and the plan
# its next entry is served from. Types and the notes the region's bookkeeping takes
# (core/regioncache.pxd); the planned take itself is core/planned.pxd's. Under the pool's lock.
from libc.stdint cimport uintptr_t, int64_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block

cdef enum PlanCall:
    PL_ENTRY = 0        # an entry starts: its requests count from 0
    PL_READ = 1         # the events recorded and the entry's hits and misses, to the caller
    PL_INSTALL = 2      # the caller's plan becomes the one served, its range placed
    PL_CLEAR = 3        # no plan
    PL_LAYOUT = 4       # where a new plan goes: a segment, and the blocks staying in it
    PL_RECORD = 5       # a record step's request 0 waits for its plan: its bytes, and where
                        # that plan goes (PL_LAYOUT's, the entry before's live blocks movable)
    PL_OVER = 6         # the installed plan's record_over and first_under become the caller's

cdef enum PlanWay:
    # How a request of a planned region treats request 0 of a record step (core/planned.pxd)
    PW_SLOW_PATH = 0    # it goes online; the caller runs the region's slow path after it
                        # (Pool.allocate_on: rc.on_alloc)
    PW_HAND_BACK = 1    # it is handed back undone (GP_RECORDED), for a caller that runs no
                        # Python after an allocation (the C API) to make it again PW_ONLINE
                        # and then run the slow path itself
    PW_ONLINE = 2       # a request the plan took in already, made again (handed back, or
                        # retried after the on_oom callbacks): online, not counted again

cdef struct PlanEvent:
    uintptr_t ptr           # the block's address; 0: an entry starts
    size_t nbytes           # an allocation's bytes (rounded); 0: a free
    uintptr_t stream        # an allocation's stream handle

cdef struct PlanHint:
    # Where a walk to request k's place may start (core/planned.pxd's pl_block_at): the last
    # of a run of live blocks that are not planned ones (the blocks a plan places around),
    # the run just below the place when the plan was installed. It holds while a live block
    # still starts at ptr (the record is then in the segment's tiling, just below the place).
    Block* block                    # NULL: no such run below the place
    uintptr_t ptr

cdef cppclass PlanTable:
    vector[PlanEvent] events        # recorded since the region last read them, once one
                                    # differed from last's (all of them); empty while matching
    vector[PlanEvent] last          # the events the region read last (PL_READ)
    bint matching                   # the events since the last read are last's first
                                    # `matched`, not copied into events (pt_log); False in a
                                    # new table (made with `new PlanTable()`: zeroed)
    size_t matched
    size_t nlast                    # last.size() while matching, else 0: pt_log compares an
                                    # event with last's only while matched < nlast (one load)
    bint same                       # PL_READ: the events read are the same as the read
                                    # before's, and not copied to io.events (the caller's
                                    # input: it holds the last read's; output: they were)
    bint active                     # a plan is installed
    size_t nbytes                   # its range's bytes
    uintptr_t base                  # the address of its offset 0
    vector[int64_t] offsets         # request k's place (bytes from base); -1: not planned
    vector[int64_t] sizes           # the most bytes request k may ask to be served there
    vector[uintptr_t] streams       # request k's stream handle
    vector[int64_t] anchors         # a request placed just below k and live when k comes; -1
    vector[int64_t] allocs          # the entry's event (allocations and frees) allocating k
    vector[int64_t] frees           # the event freeing k (>= length: the next entry's, + length)
    int64_t length                  # the planned step's events
    size_t event                    # this entry's events so far
    vector[Block*] live             # the live block at each place served (NULL: none)
    vector[PlanHint] hints          # request k's walk start among the blocks that stay
    size_t next                     # this entry's requests so far
    bint stopped                    # the entry left the plan's step (a request larger than its
                                    # place, another stream or event; one miss): the rest of
                                    # the entry goes the online way
    size_t hits                     # this entry's requests served at their place
    size_t misses                   # this entry's planned requests that were not
    size_t first_nbytes             # this entry's request 0's requested bytes (0: none yet)
    size_t record_over              # request 0 asking more bytes than this (requested, not
                                    # rounded) makes the entry a record step; 0: never
    size_t first_under              # request 0 asking fewer bytes than this (requested) is
                                    # off the plan's step: the entry goes online; 0: never
    size_t record_nbytes            # the record step's request 0's bytes, its plan pending; 0
    size_t record_event             # the entry's events when that plan was asked for
                                    # (PL_RECORD): it is installed only if none came since; 0
    bint lenient                    # a request larger than its place misses alone (a record
                                    # step's plan: its sizes are predicted)
    bint grows                      # a place past the segment's mapped end maps pages for it
    int64_t refit_from              # request k >= this larger than its place, after
                                    # REFIT_HITS hits, is refitted (pl_refit); -1: none is


cdef inline void pt_unmatch(PlanTable* p) noexcept nogil:
    """The events since the last read stop matching the read before's: the ones that did are
    copied into events (empty until now), and the next ones go there too."""
    if p.matching:
        p.events.assign(p.last.begin(), p.last.begin() + p.matched)
        p.matching = False
        p.matched = p.nlast = 0


cdef inline void pt_log_new(PlanTable* p, uintptr_t ptr, size_t nbytes,
                            uintptr_t stream) noexcept nogil:
    """pt_log's event that does not match: into events, after the ones that did."""
    cdef PlanEvent e
    pt_unmatch(p)
    e.ptr, e.nbytes, e.stream = ptr, nbytes, stream
    p.events.push_back(e)


cdef inline void pt_log(PlanTable* p, uintptr_t ptr, size_t nbytes, uintptr_t stream) noexcept nogil:
    """Record an event (PlanEvent's fields). While each event since the last read equals the
    one at its index in the read before's (a step that repeats), it is only counted: a read
    step's log is then written once, not once per entry (Note [Step time of planned
    regions])."""
    cdef PlanEvent* l
    if p.matched < p.nlast:             # (matching, and last has more)
        l = p.last.data() + p.matched
        if l.ptr == ptr and l.nbytes == nbytes and l.stream == stream:
            p.matched += 1
            return
    pt_log_new(p, ptr, nbytes, stream)


cdef inline void pt_note_alloc(PlanTable* p, Block* b) noexcept nogil:
    """Record an allocation of the region (its block just handed out)."""
    pt_log(p, b.ptr, b.size, b.stream.handle)
    p.event += 1


cdef inline void pt_forget(PlanTable* p, Block* b) noexcept nogil:
    """A block leaves the region (freed, kept or detached): no longer a live planned one
    (pt_note_free forgets a freed one itself)."""
    cdef size_t k = b.region.place
    if k:
        b.region.place = 0
        if k <= p.live.size() and p.live[k - 1] == b:
            p.live[k - 1] = NULL


cdef inline void pt_note_free(PlanTable* p, Block* b) noexcept nogil:
    """Record a free of one of the region's blocks, which leaves the region: forgotten
    (pt_forget, done here with the same look at its place). A block served at place k
    freed at another event than the plan's free of k is off the plan's step: the rest of
    the entry goes the online way (a tail of the entry before is freed at its event -
    length)."""
    cdef size_t k = b.region.place
    if k:
        b.region.place = 0
        if k <= p.live.size() and p.live[k - 1] == b:
            p.live[k - 1] = NULL
            if p.active and not p.stopped and \
                    p.frees[k - 1] - (0 if p.next >= k else p.length) != <int64_t>p.event:
                p.stopped = True
                p.misses += 1
    pt_log(p, b.ptr, 0, 0)
    p.event += 1


cdef inline uintptr_t pt_place(PlanTable* p, size_t k, size_t size,
                               uintptr_t stream) noexcept nogil:
    """The address of request k's place when a request of size bytes (rounded) on stream (its
    handle) at this point of the entry is planned request k, as the plan has it (a plan
    installed and followed so far, k at its event, on its stream, within its size); 0 when
    it is not (core/planned.pxd's pl_take then decides how it goes). Reads only."""
    if not p.active or p.stopped or k >= p.offsets.size() or p.offsets[k] < 0:
        return 0
    if p.allocs[k] != <int64_t>p.event or stream != p.streams[k] or \
            <int64_t>size > p.sizes[k]:
        return 0
    return p.base + <uintptr_t>p.offsets[k]


cdef inline Block* pt_served(PlanTable* p, size_t k, Block* b) noexcept nogil:
    """Request k took b at its place: counted, and b is the anchor of the requests above."""
    p.hits += 1
    p.live[k] = b
    b.region.place = k + 1
    return b


cdef inline void pt_fill(PlanTable* io, const int64_t* columns, size_t n) noexcept nogil:
    """A plan's requests into io's vectors (PL_INSTALL's input): columns holds n offsets,
    then n sizes, n stream handles (their bits), n anchors, n allocations and n frees."""
    cdef size_t i
    io.offsets.assign(columns, columns + n)
    io.sizes.assign(columns + n, columns + 2 * n)
    io.streams.resize(n)
    for i in range(n):
        io.streams[i] = <uintptr_t>columns[2 * n + i]
    io.anchors.assign(columns + 3 * n, columns + 4 * n)
    io.allocs.assign(columns + 4 * n, columns + 5 * n)
    io.frees.assign(columns + 5 * n, columns + 6 * n)


cdef inline void pt_clear(PlanTable* p) noexcept nogil:
    """No plan: every request goes the online way."""
    p.active = False
    p.record_event = 0
    p.lenient = p.grows = False
    p.record_over = p.first_under = 0
    p.refit_from = -1
    p.offsets.clear()
    p.sizes.clear()
    p.streams.clear()
    p.anchors.clear()
    p.allocs.clear()
    p.frees.clear()
    p.live.clear()
    p.hints.clear()
