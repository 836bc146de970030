# The shared path of a request, under the pool's lock (a tagged one: core/tagged.pxd's): the
# wanted streams' answer, parked blocks, the thread's held blocks beyond credit, best fit in
# stream order (the region's, the pool's, idle regions'), the magazines' blocks, growth, the
# out-of-memory ladder, the cut.
# Only core/pool.pyx cimports this (it reads the thread's state: core/thread.pxd).
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.driver.status cimport GP_RECORDED
from gpupool.records.block cimport Block, LIVE
from gpupool.records.sizes cimport SMALL_REQUEST
from gpupool.records.streams cimport StreamKey
from gpupool.history.ring cimport LOG_SOFT_TRIM, LOG_STREAM_TRIM
from gpupool.core.cutjoin cimport sg_split, sg_split_top
from gpupool.core.fastpath cimport fp_mine
from gpupool.core.freelist cimport fl_has_exact
from gpupool.core.ladder cimport ld_ladder, ld_grow_once, ld_trim_logged
from gpupool.core.magpool cimport (
    mp_take_locked, mp_flush_own, mp_flush_idle, mp_reap, mp_want, mp_give_up, mp_flush_all,
    mp_count_taken, mp_hand_out,
)
from gpupool.core.parking cimport pk_unpark, pk_flush
from gpupool.core.planned cimport pl_take, pl_started_record
from gpupool.core.plantable cimport PW_HAND_BACK, PW_ONLINE
from gpupool.core.regioncache cimport RegionCache, rc_link, rc_disown
from gpupool.core.segments cimport round_request
from gpupool.core.state cimport PoolState
from gpupool.core.streamorder cimport (
    WANTED_MAX, so_take, so_take_small, so_under_small, so_mark_blocks, so_clear_wanted,
)
from gpupool.core.tagged cimport tg_acquire
from gpupool.core.thread cimport current_cache, gp_this_thread
from gpupool.upstream.base cimport Upstream


cdef inline int ps_acquire_locked(PoolState* st, Upstream up, void* pool, size_t nbytes,
                                  StreamKey s, Block** out, int way) noexcept nogil:
    """Under the pool's lock: take a block for nbytes > 0 used on stream s for pool (its
    address: the thread's magazine and region are found by it). Returns 0 or a status
    code. way (a PlanWay, core/plantable.pxd): how a planned region's request that starts a
    record step goes: online (PW_SLOW_PATH, PW_ONLINE: not taken in by the plan again), or
    handed back undone (PW_HAND_BACK: GP_RECORDED)."""
    cdef size_t size = round_request(nbytes)
    cdef RegionCache* rc
    cdef RegionCache* owner
    cdef Block* b
    cdef bint grew = False, answered = False, top = False
    cdef int r
    if up.expandable and gp_this_thread().tag:     # (on a plain upstream a tag marks nothing)
        return tg_acquire(st, up, nbytes, s, gp_this_thread().tag, out)
    if st.segments.hard_limit and size > st.segments.hard_limit:
        size = nbytes               # only the exact request fits (>= BLOCK_ALIGN: PoolBase)
    if not st.order.wanted.empty():
        if st.order.wanted.size() > WANTED_MAX:
            # Many streams hold blocks that others want and never allocate again (most
            # likely destroyed): one synchronize frees their blocks for every stream.
            ld_trim_logged(st, up, LOG_STREAM_TRIM, WANTED_MAX, s)
        elif so_clear_wanted(&st.order, s):
            # s is allocating, so it is alive: another stream waits for its free blocks,
            # whose events are recorded now (and those of blocks its thread lets go below).
            answered = True
            mp_give_up(st, fp_mine(pool), s)
            so_mark_blocks(st, up, s)
    rc = current_cache(pool, st.process_region)
    b = NULL
    if rc != NULL and rc.plan != NULL and way != PW_ONLINE:
        b = pl_take(st, up, rc, nbytes, size, s)
        if way == PW_HAND_BACK and b == NULL and pl_started_record(rc.plan):
            return GP_RECORDED
    if b == NULL and st.nparked:
        b = pk_unpark(st, size, s, rc)
    if b == NULL and rc == NULL:
        b = mp_take_locked(st, fp_mine(pool), size, s)
    if b != NULL:
        b.state = LIVE
        st.counters.cache_hits += 1
        if rc != NULL:
            rc_link(rc, b)
            rc.hits += 1
        mp_count_taken(st, b.size)
        out[0] = b
        return 0
    if st.nparked and not fl_has_exact(&st.free, size, s):
        pk_flush(st)
    if not fl_has_exact(&st.free, size, s) and \
            (mp_flush_own(st, fp_mine(pool), size, False) + mp_flush_idle(st, fp_mine(pool), s)) \
            and answered:
        so_mark_blocks(st, up, s)
    # A small request goes below a live small block, but not one a planned entry sent online
    # after serving some at their places: the plan put those small blocks among the later
    # requests' places (Note [Small requests that leave a plan]).
    if size <= SMALL_REQUEST and up.expandable and not (rc != NULL and rc.plan != NULL and
                                                         rc.plan.active and rc.plan.hits):
        b = so_take_small(st, size, s, <void*>rc)
        top = b != NULL and so_under_small(b)
    if b == NULL:
        b = so_take(st, up, size, s, <void*>rc, False)
    if b == NULL:
        # Idle regions' cached blocks serve before the pool grows: a region never costs
        # memory that the pool alone would not.
        b = so_take(st, up, size, s, <void*>rc, True)
    if b == NULL and mp_reap(st) + mp_flush_own(st, fp_mine(pool), size, True):
        # The calling thread's held blocks (but those a small request leaves), and exited
        # threads', serve before the pool grows.
        if answered:
            so_mark_blocks(st, up, s)
        b = so_take(st, up, size, s, <void*>rc, True)
    if b == NULL:
        mp_want(st, size, s)
        r = ld_grow_once(st, up, size, s, <void*>rc)
        if r == CUDA_ERROR_OUT_OF_MEMORY and mp_flush_all(st):
            # Out of memory: the blocks threads hold in their magazines serve first
            # (before then they stay with their threads, which use them).
            b = so_take(st, up, size, s, <void*>rc, True)
    if b == NULL:
        if r == CUDA_ERROR_OUT_OF_MEMORY:
            r = ld_ladder(st, up, size, s, <void*>rc)
        if r != 0:
            return r
        grew = True
        b = so_take(st, up, size, s, <void*>rc, True)
        if b == NULL:
            return CUDA_ERROR_OUT_OF_MEMORY
    owner = rc_disown(b)
    if top:
        b = sg_split_top(st, b, size, s, owner)
    else:
        sg_split(st, b, size, s, owner)
    mp_hand_out(st, b, s, grew)
    if rc != NULL:
        rc_link(rc, b)
        if grew:
            rc.misses += 1
        else:
            rc.hits += 1
    mp_count_taken(st, b.size)
    if grew and st.soft_limit and st.counters.reserved > st.soft_limit:
        ld_trim_logged(st, up, LOG_SOFT_TRIM, st.soft_limit, s)     # only growth crosses it
    out[0] = b
    return 0
