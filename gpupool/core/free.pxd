# Freeing a block under the pool's lock: the events of the streams it was used on
# (record_stream), its region's cache or the pool's, parking; a region's end; and the pool's
# unlock, which runs the frees and region ends deferred while the lock was held by the
# freeing thread and lets go of the regions' lanes (core/lane.pxd).
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.records.streams cimport StreamKey, same_stream, unordered
from gpupool.history.ring cimport hist_on, hist_free
from gpupool.core.lock cimport ps_copy_wanted
from gpupool.core.lane cimport ln_leave
from gpupool.core.parking cimport pk_freed
from gpupool.core.cutjoin cimport sg_drain
from gpupool.core.regioncache cimport RegionCache, rc_freed_into, rc_detach
from gpupool.core.state cimport PoolState
from gpupool.core.tagged cimport tg_free
from gpupool.core.streamorder cimport so_event
from gpupool.upstream.base cimport Upstream


cdef inline void ps_free_locked(PoolState* st, Upstream up, Block* b,
                                   StreamKey s) noexcept nogil:
    """Under the pool's lock: take back live block b, last used on s."""
    cdef size_t i, size = b.size
    cdef uintptr_t e
    cdef bint ordered = True
    if b.tag:
        tg_free(st, up, b, s)           # its tag's segment keeps it (core/tagged.pxd)
        return
    if hist_on(st.segments.recording[0]):
        hist_free(st.segments.device, st.segments.pool_id, b.ptr, size, s.handle)
    b.stream = s
    b.holder = NULL
    if b.extra_streams != NULL:
        for i in range(b.extra_streams.size()):
            if same_stream(b.extra_streams[0][i], s):
                continue
            e = so_event(&st.order, up)
            if e and up.event_record(e, b.extra_streams[0][i].handle) == 0:
                if b.extra_events == NULL:
                    b.extra_events = new vector[uintptr_t]()
                b.extra_events.push_back(e)
            else:
                # No event: the use is ordered by a device synchronize instead (the block
                # must not be reused before that stream's work).
                if e:
                    st.order.events.push_back(e)
                up.clear_error()
                if up.synchronize() != 0:
                    up.clear_error()
                    ordered = False
        del b.extra_streams
        b.extra_streams = NULL
        if not ordered:
            b.stream = unordered()      # no request takes it until a synchronize
    pk_freed(st, rc_freed_into(b), b)   # its region's cache, or the pool's


cdef inline void ps_drop_region(PoolState* st, RegionCache* rc) noexcept nogil:
    """Under the pool's lock: forget region cache rc and delete it, with its plan and lane:
    its live blocks return to the pool when freed, its cached ones now."""
    cdef size_t i
    if st.process_region == rc:
        st.process_region = NULL
    if st.last_region == rc:
        st.last_region = NULL
    while rc.live_head != NULL:
        rc_detach(rc.live_head)
    sg_drain(st, rc)
    for i in range(st.regions.size()):
        if st.regions[i] == rc:
            st.regions.erase(st.regions.begin() + i)
            break
    for i in range(st.lanes.size()):
        if st.lanes[i] == rc:
            st.lanes.erase(st.lanes.begin() + i)
            rc.lane.mutex.unlock()          # empty: the lock put its blocks back
            del rc.lane
            break
    del rc.plan
    del rc


cdef inline void ps_unlock(PoolState* st, Upstream up) noexcept nogil:
    """Run the deferred frees and region ends, publish the wanted streams, let go of the
    pool's lock."""
    cdef Block* b
    while not st.deferred.empty():
        b = st.deferred.back()
        st.deferred.pop_back()
        ps_free_locked(st, up, b, b.stream)
    while not st.dropped.empty():
        ps_drop_region(st, st.dropped.back())
        st.dropped.pop_back()
    if st.nwanted or not st.order.wanted.empty():
        ps_copy_wanted(st)
    ln_leave(st)
    st.lock_thread = 0
    st.mutex.unlock()
