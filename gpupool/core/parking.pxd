# Parked blocks: a free of a block whose size is requested again at once (a scratch buffer, a
# step's temporaries of one shape) would be cut from a joined block and joined back every
# time, so the last PARK_SLOTS freed blocks of up to PARK_MAX bytes are held aside, unjoined,
# for a request of their exact size on their stream. Any other request, and everything that
# walks the free lists (trims, stream merges, region exits, the ladder), puts them back first
# (joined), so best fit always sees the whole free memory. Addresses are those the free lists
# would give: a block of the exact size, the lowest address first. Under the pool's lock.
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, FREE, PARKED
from gpupool.records.counters cimport count_freed
from gpupool.records.streams cimport StreamKey, same_stream
from gpupool.core.cutjoin cimport sg_put
from gpupool.core.regioncache cimport RegionCache, rc_own, rc_disown
from gpupool.core.state cimport PoolState, PARK_SLOTS

cdef enum:
    PARK_MAX = 64 << 20         # blocks up to this size are parked (Note [Parked and held blocks])


cdef inline bint pk_serves(Block* b, size_t size, StreamKey s, RegionCache* rc) noexcept nogil:
    """Whether parked block b may serve a request of exactly size bytes on s in rc (NULL:
    none): b is that size, last used on s, the pool's or rc's, with no record_stream
    events."""
    return b.size == size and same_stream(b.stream, s) and b.extra_events == NULL and \
        (b.region.cache == NULL or b.region.cache == <void*>rc)


cdef inline void pk_take(PoolState* st, int i) noexcept nogil:
    """Parked block i leaves the parked slots (the others keep their order) and its cache:
    the caller takes it."""
    cdef Block* b = st.parked[i]
    cdef int j
    for j in range(i, st.nparked - 1):
        st.parked[j] = st.parked[j + 1]
    st.nparked -= 1
    rc_disown(b)


cdef inline Block* pk_unpark(PoolState* st, size_t size, StreamKey s,
                             RegionCache* rc) noexcept nogil:
    """The parked block of exactly size bytes, last used on s, that the request may take
    (pk_serves), at the lowest address as best fit would choose; NULL if none."""
    cdef int i, found = -1
    cdef Block* b
    for i in range(st.nparked):
        b = st.parked[i]
        if pk_serves(b, size, s, rc) and (found < 0 or b.ptr < st.parked[found].ptr):
            found = i
    if found < 0:
        return NULL
    b = st.parked[found]
    pk_take(st, found)
    return b


cdef inline bint pk_unpark_block(PoolState* st, Block* b, size_t size, StreamKey s,
                                 RegionCache* rc) noexcept nogil:
    """Take parked block b itself, if it may serve (pk_serves); whether it was taken."""
    cdef int i
    if not pk_serves(b, size, s, rc):
        return False
    for i in range(st.nparked):
        if st.parked[i] == b:
            pk_take(st, i)
            return True
    return False


cdef inline void pk_park(PoolState* st, Block* b) noexcept nogil:
    """Hold freed block b aside (the oldest parked one goes to the free lists if full)."""
    cdef int j
    if b.size > PARK_MAX:
        pk_put(st, b)
        return
    if st.nparked == PARK_SLOTS:
        pk_put(st, st.parked[0])
        for j in range(PARK_SLOTS - 1):
            st.parked[j] = st.parked[j + 1]
        st.nparked -= 1
    b.state = PARKED
    st.parked[st.nparked] = b
    st.nparked += 1


cdef inline void pk_freed(PoolState* st, RegionCache* rc, Block* b) noexcept nogil:
    """Freed block b, its region's bookkeeping done, is cached (by rc; NULL: by the pool),
    parked (or put in the free lists, joined) and counted free."""
    cdef size_t size = b.size           # pk_park may join b
    rc_own(rc, b)
    b.used = st.counters.num_allocs     # last live now (sg_reclaim's cold blocks)
    pk_park(st, b)
    count_freed(&st.counters, size)
    st.bound -= size


cdef inline void pk_put(PoolState* st, Block* b) noexcept nogil:
    """A free (or parked) block goes into the free lists, joined with its neighbours."""
    b.state = FREE
    sg_put(st, b)


cdef inline void pk_flush(PoolState* st) noexcept nogil:
    """Put every parked block into the free lists."""
    cdef int i
    for i in range(st.nparked):
        pk_put(st, st.parked[i])
    st.nparked = 0


cdef inline int pk_flush_range(PoolState* st, uintptr_t lo, uintptr_t hi) noexcept nogil:
    """Put the parked blocks holding bytes of [lo, hi) into the free lists (a planned place
    spans them: core/planned.pxd's pl_take); the others stay parked, in their order. Returns
    how many were put back."""
    cdef int i, kept = 0, n = st.nparked
    cdef Block* b
    for i in range(st.nparked):
        b = st.parked[i]
        if b.ptr < hi and lo < b.ptr + b.size:
            pk_put(st, b)
        else:
            st.parked[kept] = b
            kept += 1
    st.nparked = kept
    return n - kept
