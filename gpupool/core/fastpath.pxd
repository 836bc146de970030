# The calling thread's magazine, without the pool's lock (core/magazine.pxd has the design):
# finding or making it, a retake of a held block, a hold of a freed one, a C API free of a
# block it handed out. Only core/pool.pyx cimports this (core/thread.pxd says why).
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block, LIVE
from gpupool.records.streams cimport (
    StreamKey, BAD_STREAM_TAG, OWN_HANDLE_TAG, current_thread, same_stream,
)
from gpupool.driver.calls cimport fork_flag
from gpupool.core.lock cimport ps_lock, wanted_bit
from gpupool.core.magazine cimport (
    Magazine, MAG_SLOTS, MAG_HANDED, mg_find, mg_remove, mg_find_handed, mg_unhand,
)
from gpupool.core.magpool cimport MAG_MAX, mp_hold, mp_drop
from gpupool.core.free cimport ps_unlock
from gpupool.core.segments cimport round_request
from gpupool.core.state cimport PoolState, WANTED_FAST
from gpupool.core.thread cimport (
    gp_thread, gp_thread_magazine, gp_this_thread, gp_thread_alive, gp_arm_reaper,
    GP_THREAD_POOLS,
)
from gpupool.upstream.base cimport Upstream

cdef enum:
    # Pauses (x86 `pause`: 10 to 140 cycles by model) a thread waits at most for its own
    # magazine's lock while a sweep of the pool holds it, before taking the shared path.
    MAG_SPINS = 1024


cdef inline void fp_reclaim(gp_thread_magazine* slot) noexcept nogil:
    """The calling thread deletes its magazine in slot, whose pool is gone, and frees the
    slot. Its lock is taken first: the pool's dealloc may still be letting go of it."""
    cdef Magazine* m = <Magazine*>slot.magazine
    m.mutex.lock()
    m.mutex.unlock()
    del m
    slot.pool = NULL
    slot.magazine = NULL


cdef inline Magazine* fp_find(void* pool, int* empty) noexcept nogil:
    """The calling thread's magazine for pool; NULL if none (empty: a free slot of its table,
    or -1). A magazine whose pool is gone (another pool now at this address) is deleted
    here, by its thread."""
    cdef gp_thread_magazine* slots = gp_this_thread().magazines
    cdef int i
    cdef Magazine* m
    for i in range(GP_THREAD_POOLS):
        if slots[i].pool == pool:
            m = <Magazine*>slots[i].magazine
            if m.pool == pool:              # no lock: only this pool's dealloc clears it
                return m
            fp_reclaim(&slots[i])           # the pool it was made for is gone
            empty[0] = i
        elif slots[i].pool == NULL and empty[0] < 0:
            empty[0] = i
    return NULL


cdef inline Magazine* fp_mine(void* pool) noexcept nogil:
    """The calling thread's magazine for pool; NULL if none."""
    cdef int empty = -1
    return fp_find(pool, &empty)


cdef inline Magazine* fp_thread_magazine(PoolState* st, Upstream up, void* pool,
                                         bint make) noexcept nogil:
    """The calling thread's magazine for pool (fp_find); made if make and there is none (and
    the thread's table has room); NULL otherwise."""
    cdef gp_thread_magazine* slots
    cdef int i, empty = -1
    cdef Magazine* m = fp_find(pool, &empty)
    if m != NULL:
        return m
    if not make or fork_flag()[0] or not gp_thread_alive():
        return NULL
    slots = gp_this_thread().magazines
    if empty < 0:
        # Every slot taken: those of pools that are gone are free again.
        for i in range(GP_THREAD_POOLS):
            if (<Magazine*>slots[i].magazine).pool == NULL:
                fp_reclaim(&slots[i])
                empty = i
        if empty < 0:
            return NULL
    m = new Magazine()
    m.pool = pool
    m.orphan = False
    m.nblocks = m.nhanded = 0
    m.misses = m.requests = m.seen = m.settled = 0
    m.held = m.credit = m.allocs = m.frees = m.allocated_bytes = m.freed_bytes = 0
    m.wanted = m.no_block = m.no_credit = m.no_hand = m.empty = m.waits = m.free_waits = 0
    if st.lock_thread == current_thread():
        st.magazines.push_back(m)           # a free inside an upstream call: locked already
    else:
        ps_lock(st)
        st.magazines.push_back(m)
        ps_unlock(st, up)
    slots[empty].pool = pool
    slots[empty].magazine = <void*>m
    gp_arm_reaper()
    return m


cdef inline bint fp_wait(PoolState* st, Magazine* m, size_t* waits) noexcept nogil:
    """The calling thread's magazine m, whose lock another thread holds: the pool's lock
    holder, sweeping every magazine (each for a few loads and stores). Waits for it a while
    (MAG_SPINS pauses) and counts the wait, since the shared path would wait for that
    holder's pool lock and then sweep every magazine itself, so that other threads found
    theirs taken in turn. Whether it got the lock: not when the calling thread holds the
    pool's lock (a free inside an upstream call), nor when the wait ran out (the sweeper may
    be waiting for something this thread holds, the GIL say): the shared path."""
    if st.lock_thread == current_thread():
        return False
    waits[0] += 1
    return m.mutex.try_lock_spin(MAG_SPINS)


cdef inline bint fp_is_wanted(PoolState* st, StreamKey s) noexcept nogil:
    """Without the lock: whether other streams wait for s's free blocks (the shared path
    answers them). A clear bit in the wanted mask says no at one load; a set one is looked
    for in the list (more than WANTED_FAST wanted: the bit alone says yes)."""
    cdef int i
    if not (st.wanted_mask >> wanted_bit(s)) & 1:
        return False
    if st.nwanted > WANTED_FAST:
        return True
    for i in range(st.nwanted):
        if same_stream(st.wanted[i], s):
            return True
    return False


cdef inline Block* fp_take(PoolState* st, void* pool, gp_thread* t, bint in_region,
                           size_t nbytes, StreamKey s, bint capi, bint recording) noexcept nogil:
    """A block for nbytes on s from the calling thread's magazine (t: its state), without the
    pool's lock: a held block of the exact size last used on s, within the thread's credit,
    when the thread is in no region of this pool (in_region: the caller's thread_cache found
    one) and its stream is not wanted. NULL: take the shared path (as always while the
    memory history is recording or a tag is current). capi: list it as handed (the C API
    frees by pointer)."""
    cdef size_t size
    cdef Magazine* m
    cdef Block* b = NULL
    cdef int i, empty = -1
    if nbytes > MAG_MAX or recording:
        return NULL
    if t.tag:
        return NULL                         # a tagged request: its tag's segment serves it
    if t.magazines[0].pool == pool:
        m = <Magazine*>t.magazines[0].magazine
    else:
        m = fp_find(pool, &empty)
    if m == NULL or m.pool != pool:
        return NULL
    m.requests += 1                         # its thread is active (mp_flush_idle)
    if m.nblocks == 0:
        m.empty += 1
        return NULL
    if fp_is_wanted(st, s):
        m.wanted += 1
        return NULL                         # its blocks are wanted: the shared path
    if in_region:
        return NULL
    size = round_request(nbytes)
    if not m.mutex.try_lock() and not fp_wait(st, m, &m.waits):
        return NULL
    i = mg_find(m, size, s)
    if i < 0:
        m.no_block += 1
    elif m.credit < size:
        m.no_credit += 1
    elif capi and m.nhanded >= MAG_HANDED:
        m.no_hand += 1
    else:
        b = mg_remove(m, i)
        m.credit -= size
        m.allocs += 1
        m.allocated_bytes += size
        b.state = LIVE
        if capi:
            m.handed[m.nhanded] = b
            m.nhanded += 1
    m.mutex.unlock()
    return b


cdef inline bint fp_put(PoolState* st, Upstream up, void* pool, Block* b, StreamKey s,
                        bint recording, bint enabled) noexcept nogil:
    """Hold freed block b (last used on s) in the calling thread's magazine, without the
    pool's lock when it has room. False: b is not for a magazine (a region's, a tag's, used
    on other streams, large; any while the memory history records, or with magazines not enabled) or
    the thread has none: the shared path."""
    cdef Magazine* m
    if b.size > MAG_MAX or b.region.cache != NULL or b.extra_streams != NULL or recording \
            or not enabled or b.tag:
        return False
    m = fp_thread_magazine(st, up, pool, True)
    if m == NULL:
        return False
    if m.mutex.try_lock() or fp_wait(st, m, &m.free_waits):
        if m.nblocks < MAG_SLOTS:
            mp_hold(st, m, b, s)
            m.mutex.unlock()
            return True
        m.mutex.unlock()
    if st.lock_thread == current_thread():
        return False                        # inside an upstream call: deferred
    # Full (or being flushed): the oldest held block goes to the free lists.
    ps_lock(st)
    m.mutex.lock()
    if m.nblocks == MAG_SLOTS:
        mp_drop(st, m, 0)
    mp_hold(st, m, b, s)
    m.mutex.unlock()
    ps_unlock(st, up)
    return True


cdef inline Block* fp_free_handed(PoolState* st, void* pool, uintptr_t ptr, StreamKey* s,
                                  bint recording, bint* done) noexcept nogil:
    """C API free of ptr by the calling thread: if its magazine handed ptr out, set done and
    hold it when it may be (NULL), else return it, to be freed as any other (Pool.free_block)
    once its stream (*s) is resolved. s.tag == BAD_STREAM_TAG: as last used on the block's
    own stream; OWN_HANDLE_TAG: the block's own when the handle is its stream's, else to be
    resolved by the caller (a driver call, made after the magazine's lock is let go)."""
    cdef gp_thread* t = gp_this_thread()
    cdef Magazine* m
    cdef Block* b = NULL
    cdef int i, empty = -1
    done[0] = False
    if t.magazines[0].pool == pool:
        m = <Magazine*>t.magazines[0].magazine
    else:
        m = fp_find(pool, &empty)
    if m == NULL or m.nhanded == 0:
        return NULL
    if not m.mutex.try_lock() and not fp_wait(st, m, &m.free_waits):
        return NULL
    i = mg_find_handed(m, ptr)
    if i >= 0:
        b = mg_unhand(m, i)
        done[0] = True
        if s.tag == BAD_STREAM_TAG or (s.tag == OWN_HANDLE_TAG and
                                       s.handle == b.stream.handle):
            s[0] = b.stream
        if (s.tag != OWN_HANDLE_TAG and m.nblocks < MAG_SLOTS and
                b.extra_streams == NULL and not recording):
            mp_hold(st, m, b, s[0])
            b = NULL
    m.mutex.unlock()
    return b


cdef inline void fp_detach(Magazine* m) noexcept nogil:
    """The pool of m is going (under its lock): its blocks go with the pool's memory; m is
    deleted now if its thread exited, else by its thread (fp_thread_magazine)."""
    cdef bint orphan
    m.mutex.lock()
    m.pool = NULL
    m.nblocks = m.nhanded = 0
    orphan = m.orphan
    m.mutex.unlock()
    if orphan:
        del m


cdef inline void fp_thread_exit(void* p) noexcept nogil:
    """A thread with magazines exits: each is left to its pool (which flushes and deletes
    it when it next flushes), or deleted if its pool is gone."""
    cdef Magazine* m = <Magazine*>p
    cdef bint gone
    if fork_flag()[0]:
        return          # a fork() child: a lock may have been held at the fork; leave it all
    m.mutex.lock()
    gone = m.pool == NULL
    m.orphan = True
    m.mutex.unlock()
    if gone:
        del m
