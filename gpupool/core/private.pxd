# A private pool's blocks (region/privatepool.pxd has the design): taking an exact address
# range of a private pool's free memory, and its end. Functions of the pool's state, under the
# pool's lock (Pool.private_allocate_at, Pool.private_end).
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, FREE, LIVE
from gpupool.records.ptrtable cimport pt_insert
from gpupool.records.streams cimport StreamKey
from gpupool.core.cutjoin cimport sg_split, sg_cut_front, sg_drain
from gpupool.core.freelist cimport fl_unbin
from gpupool.core.magpool cimport mp_count_taken
from gpupool.core.regioncache cimport RegionCache, rc_link, rc_disown, rc_detach
from gpupool.core.state cimport PoolState
from gpupool.core.streamorder cimport so_drop_events


cdef inline Block* pp_free_holding(RegionCache* rc, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The private pool's free block that holds [ptr, ptr + nbytes); NULL if none (parked
    blocks put back first)."""
    cdef Block* b = rc.cached_head
    while b != NULL and not (b.state == FREE and b.ptr <= ptr and
                             ptr + nbytes <= b.ptr + b.size):
        b = b.region.next
    return b


cdef inline Block* pp_take(PoolState* st, Block* b) noexcept nogil:
    """Take the private pool's free block b out of the free lists and its cache (the device's
    work on it is done: its events are dropped)."""
    fl_unbin(&st.free, b)
    rc_disown(b)
    so_drop_events(&st.order, b)
    return b


cdef inline bint pp_allocate_at(PoolState* st, RegionCache* rc, uintptr_t ptr, size_t nbytes,
                                StreamKey s) noexcept nogil:
    """Make [ptr, ptr + nbytes) of rc's free memory a live block of rc used on s, handed out
    through the C API; whether it was free there. The free memory before it and after it
    stays rc's."""
    cdef Block* b = pp_free_holding(rc, ptr, nbytes)
    if b == NULL:
        return False
    pp_take(st, b)
    if b.ptr < ptr:
        b = sg_cut_front(st, b, ptr, s, rc)    # the front stays rc's free memory
        if b == NULL:
            return False
        so_drop_events(&st.order, b)
    sg_split(st, b, nbytes, s, rc)
    b.state = LIVE
    b.stream = s
    rc_link(rc, b)
    rc.hits += 1
    st.counters.cache_hits += 1
    mp_count_taken(st, b.size)
    pt_insert(&st.capi_blocks, b.ptr, b)
    return True


cdef inline void pp_end(PoolState* st, RegionCache* rc) noexcept nogil:
    """The private pool ends: its live blocks return to the pool when freed, its free ones
    are the pool's now (the device's work on them is done)."""
    while rc.live_head != NULL:
        rc_detach(rc.live_head)
    sg_drain(st, rc)
