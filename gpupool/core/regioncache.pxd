# A region's cache: the bookkeeping of the blocks a region holds.
#
# A region keeps no free memory of its own kind: its cached blocks are free blocks of the
# pool's free lists tagged with the region (Block.region.cache), so they are cut, joined and
# served by best fit exactly as the pool's are, and on the same work a region holds no more
# than the pool alone would. While the region is entered its allocations may take its own
# blocks and the pool's (the best fit of both); other allocations take the pool's, and the
# region's only before the pool would grow (when the region is not entered). At exit, cached
# blocks that the entry did not use go back to the pool (core/cutjoin.pxd's sg_return_unused,
# joined with the pool's free neighbours).
#
# Here: the region's list of live blocks (their escape at exit), its list of cached blocks
# (tagging and untagging), and its counters. The stack of entered regions is
# core/regionstack.pxi. Everything runs under the pool's lock.
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.core.magazine cimport gp_spin
from gpupool.core.plantable cimport PlanTable, pt_note_alloc, pt_note_free, pt_forget

cdef enum:
    LANE_SLOTS = 8              # blocks a region's lane holds (core/lane.pxd)

cdef cppclass Lane:
    # A thread-scope planned region's freed blocks, kept off the pool's lock until the pool's
    # lock holder puts them back (core/lane.pxd has the design).
    char _pad_front[64]         # no cache line shared with the region's counters
    gp_spin mutex               # the fast path's; the pool's lock holder holds it throughout
    Block* blocks[LANE_SLOTS]   # state HELD, oldest first, each with its stream in .stream
    int nblocks
    size_t retakes              # blocks freed into it and taken again since the pool saw it
    size_t retaken_bytes
    char _pad_back[64]

cdef cppclass RegionCache:
    void* pool                  # the Pool it belongs to (borrowed; the Region keeps it alive)
    Block* live_head
    Block* cached_head          # its cached (free) blocks
    size_t entries              # entries so far: the stamp of blocks used by this entry
    int entered                 # threads it is entered on (0: idle, its blocks may be lent)
    size_t live_count
    size_t live_bytes           # bytes of its live blocks: the region's bytes in use
    size_t escaped_bytes        # bytes of its blocks that outlived an exit and are still live
    size_t cached_bytes
    size_t peak_in_use_bytes
    size_t hits                 # its allocations served from free memory
    size_t misses               # its allocations that needed new memory
    size_t lane_hits            # of its hits, those its lane served (core/lane.pxd)
    size_t max_cached_bytes     # 0: no cap
    bint held                   # a private pool's (region/privatepool.pxd): joins no pool block
    PyObject* on_alloc          # called with each new block's pointer (trace=True); borrowed
    PyObject* on_record         # a planned region's slow path for a record step's plan,
                                # swapped with on_alloc while one is pending; borrowed
    PlanTable* plan             # a planned region's (core/plantable.pxd); NULL: none
    Lane* lane                  # a thread-scope planned region's (core/lane.pxd); NULL: none
    bint shared                 # a planned region that another thread's region takes turns
                                # with: it caches nothing and serves no plan (core/turns.pxd)
    size_t quiet                # its entries in a row since its last turn (core/turns.pxd)
    size_t shared_entries       # its entries made while shared
    uintptr_t thread            # the thread of its last entry (records/streams' current_thread)


cdef inline bint rc_lends(RegionCache* rc) noexcept nogil:
    """Whether the region's cached blocks may serve others (before the pool grows)."""
    return rc.entered == 0


cdef inline void rc_link(RegionCache* rc, Block* b) noexcept nogil:
    """b, just handed out inside the region, joins its list of live blocks."""
    b.region.cache = <void*>rc
    b.region.escaped = False
    b.region.stamp = rc.entries         # live: the entry that allocated it
    b.region.prev = NULL
    b.region.next = rc.live_head
    if rc.live_head != NULL:
        rc.live_head.region.prev = b
    rc.live_head = b
    rc.live_count += 1
    rc.live_bytes += b.size
    if rc.live_bytes > rc.peak_in_use_bytes:
        rc.peak_in_use_bytes = rc.live_bytes
    if rc.plan != NULL:
        pt_note_alloc(rc.plan, b)


cdef inline void _unlink(Block** head, Block* b) noexcept nogil:
    if b.region.prev != NULL:
        b.region.prev.region.next = b.region.next
    else:
        head[0] = b.region.next
    if b.region.next != NULL:
        b.region.next.region.prev = b.region.prev
    b.region.prev = b.region.next = NULL


cdef inline void rc_detach(Block* b) noexcept nogil:
    """Unlink a live block from its region (the block then returns to the pool)."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    if rc == NULL:
        return
    if rc.plan != NULL:
        pt_forget(rc.plan, b)
    if b.region.escaped:
        _unlink(&rc.live_head, b)
        rc.escaped_bytes -= b.size
        b.region.cache = NULL
        b.region.escaped = False
    else:
        _unlist_live(rc, b)


cdef inline void _unlist_live(RegionCache* rc, Block* b) noexcept nogil:
    """A live block of rc that did not escape an exit leaves rc's live blocks and counts."""
    _unlink(&rc.live_head, b)
    rc.live_count -= 1
    rc.live_bytes -= b.size
    b.region.cache = NULL


cdef inline void rc_escape(Block* b) noexcept nogil:
    """A live block outlived its region's exit: it stays listed (its bytes count as escaped
    until it dies) but returns to the pool when freed."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    b.region.escaped = True
    rc.live_count -= 1
    rc.live_bytes -= b.size
    rc.escaped_bytes += b.size


cdef inline void rc_own(RegionCache* rc, Block* b) noexcept nogil:
    """Tag free block b as cached by rc (NULL: by the pool), used by rc's current entry."""
    b.region.cache = <void*>rc
    if rc == NULL:
        return
    b.region.stamp = rc.entries
    b.region.prev = NULL
    b.region.next = rc.cached_head
    if rc.cached_head != NULL:
        rc.cached_head.region.prev = b
    rc.cached_head = b
    rc.cached_bytes += b.size


cdef inline RegionCache* rc_disown(Block* b) noexcept nogil:
    """Untag a free block (it is the pool's now); returns the region that cached it."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    if rc != NULL:
        _unlink(&rc.cached_head, b)
        rc.cached_bytes -= b.size
        b.region.cache = NULL
    return rc


cdef inline bint rc_room(RegionCache* rc, size_t nbytes) noexcept nogil:
    """Whether rc may cache nbytes more within its cap (max_cached_bytes; 0: none)."""
    return not rc.max_cached_bytes or rc.cached_bytes + nbytes <= rc.max_cached_bytes


cdef inline RegionCache* rc_freed_into(Block* b) noexcept nogil:
    """A live block is freed: unlinked from its region's live blocks; the region that caches
    it now (its own, used by this entry), or NULL when it returns to the pool (it escaped an
    exit, the region's cache is full or shared (core/turns.pxd), or it has no region)."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    cdef bint escaped
    if rc == NULL:
        return NULL
    escaped = b.region.escaped
    if rc.plan != NULL:
        pt_note_free(rc.plan, b)
    rc_detach(b)
    if escaped or rc.shared or not rc_room(rc, b.size):
        return NULL
    return rc


cdef inline void rc_freed_kept(RegionCache* rc, Block* b) noexcept nogil:
    """rc_freed_into for a live block of rc, a planned region with no cap on its cache, that
    did not escape an exit (core/lane.pxd's ln_put checked all three): rc caches it. The
    same steps, less the checks that those facts answer."""
    pt_note_free(rc.plan, b)            # (which forgets its place: pt_forget has nothing left)
    _unlist_live(rc, b)                 # (rc_detach's path for it, less its checks)


cdef inline int rc_slow_path(Block* b) except -1:
    """Run the allocation slow path of the region of b, a block just handed out (trace's
    site, a record step's plan: RegionCache.on_alloc), if it has one; with the GIL, outside
    the pool's lock. Raises what it raises."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    if rc != NULL and rc.on_alloc != NULL:
        (<object>rc.on_alloc)(b.ptr)
    return 0


cdef inline void rc_live_blocks(RegionCache* rc, vector[Block*]* out) noexcept nogil:
    """Append the region's live blocks (those that escaped an earlier exit included)."""
    cdef Block* b = rc.live_head
    while b != NULL:
        out.push_back(b)
        b = b.region.next


cdef inline Block* rc_find_live(RegionCache* rc, uintptr_t ptr) noexcept nogil:
    """The region's live block whose memory holds ptr; NULL if none."""
    cdef Block* b = rc.live_head
    while b != NULL and not (b.ptr <= ptr < b.ptr + b.size):
        b = b.region.next
    return b
