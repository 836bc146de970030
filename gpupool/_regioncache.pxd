# A region's cache: the free lists its blocks return to, the list of its live blocks, their
# escape at exit and the drain of its cache into the pool; and the per-thread stack of entered
# regions that decides which cache an allocation goes through (_regionstack.pxi). The pool
# asks the cache in front of it (rc_take) before its own free lists, and offers it each freed
# block of its own (rc_put). Everything here runs under the pool's lock. The stack of entered
# regions is _regionstack.pxi.
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool._block cimport Block, FREE_REGION
from gpupool._counters cimport Counters
from gpupool._freelist cimport FreeLists, fl_put, fl_take_all
from gpupool._streamorder cimport StreamOrder, so_take
from gpupool._streams cimport StreamKey
from gpupool._upstream cimport Upstream

cdef cppclass RegionCache:
    void* pool                  # the Pool it belongs to (borrowed; the Region keeps it alive)
    FreeLists free
    Block* live_head
    size_t live_count
    size_t live_bytes           # bytes of its live blocks: the region's bytes in use
    size_t escaped_bytes        # bytes of its blocks that outlived an exit and are still live
    size_t cached_bytes
    size_t peak_in_use_bytes
    size_t hits
    size_t misses
    size_t max_cached_bytes     # 0: no cap
    PyObject* on_alloc          # called with each new block's pointer (trace=True); borrowed


cdef inline Block* rc_take(RegionCache* rc, StreamOrder* so, Upstream up, int cls,
                           StreamKey s) noexcept nogil:
    """A cached block of class cls for stream s, out of the region's lists; NULL on a miss.
    Counts the hit or miss."""
    cdef Block* b = so_take(so, up, &rc.free, cls, s)
    if b != NULL:
        rc.hits += 1
        rc.cached_bytes -= b.size
    else:
        rc.misses += 1
    return b


cdef inline void rc_link(RegionCache* rc, Block* b) noexcept nogil:
    """b, just handed out inside the region, joins its list of live blocks."""
    b.region.cache = <void*>rc
    b.region.prev = NULL
    b.region.next = rc.live_head
    if rc.live_head != NULL:
        rc.live_head.region.prev = b
    rc.live_head = b
    rc.live_count += 1
    rc.live_bytes += b.size
    if rc.live_bytes > rc.peak_in_use_bytes:
        rc.peak_in_use_bytes = rc.live_bytes


cdef inline void rc_detach(Block* b) noexcept nogil:
    """Unlink a live block from its region (the block then returns to the pool)."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    if rc == NULL:
        return
    if b.region.prev != NULL:
        b.region.prev.region.next = b.region.next
    else:
        rc.live_head = b.region.next
    if b.region.next != NULL:
        b.region.next.region.prev = b.region.prev
    b.region.prev = b.region.next = NULL
    if b.region.escaped:
        rc.escaped_bytes -= b.size
    else:
        rc.live_count -= 1
        rc.live_bytes -= b.size
    b.region.cache = NULL
    b.region.escaped = False


cdef inline void rc_escape(Block* b) noexcept nogil:
    """A live block outlived its region's exit: it stays listed (its bytes count as escaped
    until it dies) but returns to the pool when freed."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    b.region.escaped = True
    rc.live_count -= 1
    rc.live_bytes -= b.size
    rc.escaped_bytes += b.size


cdef inline bint rc_put(Block* b) noexcept nogil:
    """A live block of a region (b.region.cache is set) is freed: unlinked from its region,
    and kept in the region's free lists unless it escaped an exit or the region's cache is
    full. Whether it was kept (else it is the pool's, with no region)."""
    cdef RegionCache* rc = <RegionCache*>b.region.cache
    cdef bint escaped
    escaped = b.region.escaped
    rc_detach(b)
    if escaped or (rc.max_cached_bytes and rc.cached_bytes + b.size > rc.max_cached_bytes):
        return False
    b.region.cache = <void*>rc
    b.state = FREE_REGION
    rc.cached_bytes += b.size
    fl_put(&rc.free, b)
    return True


cdef inline void rc_drain(RegionCache* rc, vector[Block*]* out) noexcept nogil:
    """Move every cached block of the region to out (for the pool's free lists)."""
    cdef size_t i, start = out.size()
    fl_take_all(&rc.free, out)
    for i in range(start, out.size()):
        out[0][i].region.cache = NULL
    rc.cached_bytes = 0


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
