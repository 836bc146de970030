# Blocks handed out by pointer (the C API frees by pointer, not by buffer): finding one, and
# what the C API reports of the pool's free memory. Functions of the pool's state, under the
# pool's lock.
from libc.stdint cimport uintptr_t, SIZE_MAX
from libcpp.vector cimport vector
from gpupool.records.block cimport Block
from gpupool.records.ptrtable cimport pt_lookup
from gpupool.core.freelist cimport fl_each
from gpupool.core.magazine cimport Magazine
from gpupool.core.magpool cimport mp_find_handed, mp_flush_mine, mp_largest_held
from gpupool.core.parking cimport pk_flush
from gpupool.core.regioncache cimport RegionCache, rc_lends
from gpupool.core.state cimport PoolState


cdef inline Block* hd_find(PoolState* st, uintptr_t ptr, bint remove) noexcept nogil:
    """Under the pool's lock: the live block at ptr handed out by pointer, from the
    pool's table or a thread's magazine (taken off if remove); NULL if none."""
    cdef Block* b = pt_lookup(&st.capi_blocks, ptr, remove)
    if b == NULL:
        b = mp_find_handed(st, ptr, remove)
    return b


cdef inline void hd_cache_info(PoolState* st, Magazine* mine, size_t* largest,
                               size_t* headroom) noexcept nogil:
    """The largest free block any request may take (the pool's and idle regions', and
    threads' held blocks: served under pressure), and the bytes left under the hard
    limit (SIZE_MAX: none)."""
    cdef vector[Block*] blocks
    cdef RegionCache* rc
    cdef size_t i, held, limit = st.segments.hard_limit
    pk_flush(st)
    # The caller's held blocks, joined, as its request sees them.
    mp_flush_mine(st, mine)
    fl_each(&st.free, &blocks)
    largest[0] = 0
    for i in range(blocks.size()):
        rc = <RegionCache*>blocks[i].region.cache
        if (rc == NULL or rc_lends(rc)) and blocks[i].size > largest[0]:
            largest[0] = blocks[i].size
    held = mp_largest_held(st)
    if held > largest[0]:
        largest[0] = held
    if not limit:
        headroom[0] = SIZE_MAX
    else:
        headroom[0] = (limit - st.counters.reserved
                       if limit > st.counters.reserved else 0)


cdef inline size_t hd_private_live(RegionCache* rc, uintptr_t* ptrs, size_t* sizes,
                                   size_t capacity) noexcept nogil:
    """The live blocks of private pool rc: the first capacity ones' pointers and sizes
    go to ptrs and sizes; returns how many there are."""
    cdef Block* b
    cdef size_t n = 0
    b = rc.live_head
    while b != NULL:
        if n < capacity:
            ptrs[n] = b.ptr
            sizes[n] = b.size
        n += 1
        b = b.region.next
    return n
