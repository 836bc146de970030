# Private pools: memory held for one user, a CUDA graph's private memory pool (PyTorch's
# beginAllocateToPool / releasePool, through the C API's private_* functions).
#
# A private pool is a region cache (core/regioncache.pxd) of the device's pool that is held
# entered from its making to its end and is not registered with the pool. Its allocations
# take the best fit of its own free blocks and the pool's, as a region's do; once freed they
# stay its own: never lent (it is always entered), never untagged by the out-of-memory ladder
# or Region.release() (they see registered regions only), never given back by a trim (which
# keeps tagged blocks). So the addresses a captured graph baked in are the graph's for as long
# as it lives, and a later capture into the same private pool reuses them. At the end, once
# the device's work on its memory is done, its free blocks go back to the pool and its live
# ones return there when freed. Everything here runs under the pool's lock.
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, FREE, LIVE
from gpupool.core.freelist cimport fl_unbin
from gpupool.core.pool cimport Pool
from gpupool.records.ptrtable cimport pt_insert
from gpupool.core.regioncache cimport RegionCache, rc_link, rc_own, rc_disown, rc_detach, rc_drain
from gpupool.core.cutjoin cimport sg_split, sg_put
from gpupool.core.streamorder cimport so_drop_events
from gpupool.records.streams cimport StreamKey

cdef struct PrivatePool:
    PyObject* pool          # the Pool it draws from (a reference is held)
    RegionCache* rc         # its blocks: rc.pool is the Pool, rc.entered stays 1


cdef inline Block* pp_free_holding(RegionCache* rc, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The private pool's free block that holds [ptr, ptr + nbytes); NULL if none (parked
    blocks put back first)."""
    cdef Block* b = rc.cached_head
    while b != NULL and not (b.state == FREE and b.ptr <= ptr and
                             ptr + nbytes <= b.ptr + b.size):
        b = b.region.next
    return b


cdef inline Block* pp_take(Pool pool, Block* b) noexcept nogil:
    """Take the private pool's free block b out of the free lists and its cache (the device's
    work on it is done: its events are dropped)."""
    fl_unbin(&pool._st.free, b)
    rc_disown(b)
    so_drop_events(&pool._st.order, b)
    return b


cdef inline bint pp_allocate_at(Pool pool, RegionCache* rc, uintptr_t ptr, size_t nbytes,
                                StreamKey s) noexcept nogil:
    """Make [ptr, ptr + nbytes) of rc's free memory a live block of rc used on s, handed out
    through the C API; whether it was free there. The free memory before it and after it
    stays rc's."""
    cdef Block* b = pp_free_holding(rc, ptr, nbytes)
    cdef Block* front
    if b == NULL:
        return False
    pp_take(pool, b)
    if b.ptr < ptr:
        # Cut the front off (sg_split leaves the rest, from ptr on, free in the lists), then
        # take the rest and give the front back; the rest is LIVE while the front is put,
        # so that the two do not join again.
        front = b
        sg_split(&pool._st, front, ptr - front.ptr, s, rc)
        b = front.seg_next
        front.state = FREE
        if b == NULL or b.ptr != ptr:           # not cut (no host memory for a record)
            rc_own(rc, front)
            sg_put(&pool._st, front)
            return False
        pp_take(pool, b)
        b.state = LIVE
        rc_own(rc, front)
        sg_put(&pool._st, front)
    sg_split(&pool._st, b, nbytes, s, rc)
    b.state = LIVE
    b.stream = s
    rc_link(rc, b)
    rc.hits += 1
    pool._st.counters.cache_hits += 1
    pool.count_taken(b.size)
    pt_insert(&pool._st.capi_blocks, b.ptr, b)
    return True


cdef inline void pp_end(RegionCache* rc) noexcept nogil:
    """The private pool ends: its live blocks return to the pool when freed, its free ones
    are the pool's now (the device's work on them is done)."""
    while rc.live_head != NULL:
        rc_detach(rc.live_head)
    rc_drain(rc)
