# Planned regions of several threads on one pool (Note [Planned regions on several threads] in
# docs/design.md): when two regions of the pool take turns on different threads, a planned
# one among them serves its entries the pool's way until it has had QUIET_ENTRIES entries of
# its own in a row with no other thread's region entered. Its plan would lie around the other
# threads' blocks of the moment, and its cache would hold free memory that they cannot join
# or, while it is entered, take: on the same work it would hold more than the pool alone.
# Under the pool's lock; only core/pool.pyx (Pool.region_enter) uses it.
from libc.stdint cimport uintptr_t
from gpupool.core.cutjoin cimport sg_drain
from gpupool.core.planned cimport pl_unrecord
from gpupool.core.plantable cimport pt_clear
from gpupool.core.regioncache cimport RegionCache
from gpupool.core.state cimport PoolState

cdef enum:
    QUIET_ENTRIES = 8           # entries in a row, with no other thread's region entered,
                                # before a shared planned region plans again


cdef inline void rt_share(PoolState* st, RegionCache* rc) noexcept nogil:
    """rc, a region another thread's region takes turns with, caches nothing and serves no
    plan (a plain region is left as it is): an entry under way goes on online, as one that
    left its plan's step, and its cached blocks go back to the pool joined with their free
    neighbours, so that the other threads' requests take them whole."""
    if rc.plan == NULL:
        return
    rc.quiet = 0
    if rc.shared:
        return
    rc.shared = True
    pl_unrecord(rc)
    pt_clear(rc.plan)
    rc.plan.stopped = True      # (its exit tells the planner so: not the plan's failure)
    sg_drain(st, rc)


cdef inline void rt_entered(PoolState* st, RegionCache* rc, uintptr_t thread) noexcept nogil:
    """A new entry of rc on thread: when the pool's last entry was another region's on
    another thread, or another region is entered on another thread now, both are shared
    (rt_share); else a shared rc counts a quiet entry, and plans again after QUIET_ENTRIES."""
    cdef RegionCache* other
    cdef bint turn = False
    cdef size_t i
    if st.last_region != NULL and st.last_region != rc and st.last_thread != thread:
        rt_share(st, st.last_region)
        turn = True
    for i in range(st.regions.size()):
        other = st.regions[i]
        if other != rc and other.entered and other.thread != thread:
            rt_share(st, other)
            turn = True
    if turn:
        rt_share(st, rc)
    elif rc.shared:
        rc.quiet += 1
        rc.shared = rc.quiet < QUIET_ENTRIES
    rc.thread = thread
    st.last_region, st.last_thread = rc, thread
