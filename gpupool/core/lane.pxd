# A region's lane: a planned region's allocate + free pair without the pool's lock (Note [Region
# lanes] in docs/design.md).
#
# A block of a thread-scope planned region that is following its plan, freed on a thread the
# region is entered on, waits in the region's lane (at most LANE_SLOTS of them), and a request
# of that thread in the region that the plan places exactly there, of its size on its stream,
# takes it back: the block the planned take (core/planned.pxd) would have taken, parked. Both
# run under the lane's own lock instead of the pool's, and do the region's bookkeeping (its
# live blocks, its plan's notes) there. (A plain region has none: its online requests would
# take a lane's block where best fit over all the parked and free blocks takes another, and on
# the same work a region holds what the pool alone would: Note [Regions and magazines].)
#
# Nothing that takes the pool's lock ever sees a lane. The pool's lock holder takes every
# lane's lock right after the pool's (ps_lock, core/lock.pxd) and keeps them until it lets go
# (ps_unlock, core/free.pxd), and first puts each lane's blocks where the shared free would
# have put them (cached by the region, parked) and counts their frees and the lane's retakes.
# So the regions' bookkeeping is written either under the pool's lock and every lane's, or
# under one lane's by the fast path, which touches nothing of the pool's: no sweep, statistic,
# snapshot or other thread finds a block in a lane, and bytes in use are exact whenever they
# are read. Until then a lane's blocks count as in use (as a magazine's do): a retake never
# raises bytes in use, so the peak needs no credit here. Order: the pool's lock, then the
# lanes', then the magazines'; the fast path holds one lane's lock alone and never waits
# while holding it.
from libc.stdint cimport uintptr_t
from gpupool.records.counters cimport count_fast
from gpupool.records.block cimport Block, LIVE, HELD
from gpupool.records.streams cimport StreamKey, same_stream
from gpupool.core.parking cimport pk_freed
from gpupool.core.plantable cimport PlanTable, pt_place, pt_served
from gpupool.core.regioncache cimport (
    RegionCache, Lane, LANE_SLOTS, rc_link, rc_freed_kept,
)
from gpupool.core.state cimport PoolState


cdef inline Block* ln_take(RegionCache* rc, size_t size, StreamKey s) noexcept nogil:
    """A block of exactly size bytes (rounded) for a request on s of the calling thread in
    rc, a thread-scope planned region, from its lane, without the pool's lock: the block at
    the place of planned request k, when the request is k (k > 0: request 0 may start a
    record step). NULL: take the shared path (no such block, or the lane's lock held: the
    pool's lock holder's)."""
    cdef Lane* l = rc.lane
    cdef PlanTable* p = rc.plan
    cdef Block* b
    cdef uintptr_t place
    cdef int i, j
    if l.nblocks == 0 or not l.mutex.try_lock():
        return NULL
    place = pt_place(p, p.next, size, s.handle) if p.next else 0
    for i in range(l.nblocks if place else 0):
        b = l.blocks[i]
        if b.ptr == place and b.size == size and same_stream(b.stream, s):
            for j in range(i, l.nblocks - 1):
                l.blocks[j] = l.blocks[j + 1]
            l.nblocks -= 1
            b.state = LIVE
            pt_served(p, p.next, b)
            p.next += 1
            rc_link(rc, b)
            rc.hits += 1
            rc.lane_hits += 1
            l.retakes += 1
            l.retaken_bytes += size
            l.mutex.unlock()
            return b
    l.mutex.unlock()
    return NULL


cdef inline bint ln_put(RegionCache* rc, Block* b, StreamKey s) noexcept nogil:
    """Freed block b, last used on s, of rc (a thread-scope planned region, entered on the
    calling thread), into rc's lane, without the pool's lock; False: the shared path (a
    block that escaped an exit, used on other streams (record_stream) or tagged, a region
    with a cap on its cache or off its plan, the lane full or its lock held)."""
    cdef Lane* l = rc.lane
    if b.tag or b.extra_streams != NULL or b.extra_events != NULL or rc.max_cached_bytes \
            or not l.mutex.try_lock():
        return False
    if l.nblocks == LANE_SLOTS or b.region.cache != <void*>rc or b.region.escaped or \
            not rc.plan.active or rc.plan.stopped:
        l.mutex.unlock()                # (b's region fields are stable under the lane's lock)
        return False
    rc_freed_kept(rc, b)                # rc caches it (rc_freed_into: not escaped, no cap)
    b.stream = s
    b.holder = NULL
    b.state = HELD
    l.blocks[l.nblocks] = b
    l.nblocks += 1
    l.mutex.unlock()
    return True


cdef inline void ln_enter(PoolState* st) noexcept nogil:
    """The pool's lock was just taken: take every lane's lock too (until ln_leave), and put
    each lane's blocks back as the shared free would have (their region caches them,
    parked), counting the lanes' frees and retakes."""
    cdef size_t i
    cdef int j
    cdef RegionCache* rc
    cdef Lane* l
    for i in range(st.lanes.size()):
        rc = st.lanes[i]
        l = rc.lane
        l.mutex.lock()
        # Each retake a free and an allocation, which left bytes in use as they were.
        count_fast(&st.counters, l.retakes, l.retaken_bytes, l.retakes, l.retaken_bytes)
        l.retakes = l.retaken_bytes = 0
        for j in range(l.nblocks):
            pk_freed(st, rc, l.blocks[j])
        l.nblocks = 0


cdef inline void ln_leave(PoolState* st) noexcept nogil:
    """The pool's lock is let go: the lanes' locks first."""
    cdef size_t i
    for i in range(st.lanes.size()):
        st.lanes[i].lane.mutex.unlock()
