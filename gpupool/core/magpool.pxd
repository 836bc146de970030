# The pool's side of the threads' magazines (core/magazine.pxd has the design): what the
# shared path does with them under the pool's lock (retakes beyond credit, flushes, sweeps,
# the peak's settling, the counters' view), as functions of the pool's state. The lock-free
# fast path (a thread's own take and hold) stays in core/pool.pyx, next to the thread's state.
from libc.stdint cimport uintptr_t
from libcpp.algorithm cimport sort
from libcpp.pair cimport pair
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, HELD, LIVE
from gpupool.records.counters cimport Counters, count_acquired, count_fast
from gpupool.records.streams cimport StreamKey, same_stream
from gpupool.core.magazine cimport (
    Magazine, mg_find, mg_largest, mg_remove, mg_find_handed, mg_unhand,
)
from gpupool.core.parking cimport pk_put
from gpupool.core.state cimport (
    PoolState, SWEEP_OTHERS, SWEEP_WANT, SWEEP_HANDED, SWEEP_SETTLE,
)
from gpupool.core.streamorder cimport so_mark_wanted

cdef enum:
    MAG_MAX = 64 << 20          # blocks up to this size are held (Note [Parked and held blocks])
    MAG_AGE = 2                 # misses of its thread a held block outlives (mp_flush_own)
    # A small request (at most MAG_SMALL bytes: PyTorch's small-pool bound) leaves the calling
    # thread's held blocks of MAG_KEEP times its size or more where they are (mp_keeps).
    MAG_SMALL = 1 << 20
    MAG_KEEP = 8


cdef inline bint mp_keeps(Block* b, size_t size) noexcept nogil:
    """Whether a request of size bytes leaves held block b in its thread's magazine: a small
    request does not break a block of MAG_KEEP times its size or more; the pool grows for it
    instead (on an expandable upstream a page at most; on a plain one a new segment, up to
    20 MiB when shared), or, out of memory, every magazine is flushed first. Without this, a
    thread cycling through small and large sizes on an expandable segment (one range per
    stream) would cut the small blocks from its large one and join them back for the next
    large request, every request taking the pool's lock (see Note [Magazine keeps large
    blocks for small requests])."""
    return size <= MAG_SMALL and b.size >= MAG_KEEP * size


cdef inline Block* mp_take_locked(PoolState* st, Magazine* m, size_t size,
                                  StreamKey s) noexcept nogil:
    """Under the pool's lock: the calling thread's held block of exactly size bytes on
    s, beyond its credit (counted as a shared acquire). NULL if none."""
    cdef Block* b = NULL
    cdef size_t spent
    cdef int i
    if m == NULL or m.nblocks == 0:
        return NULL
    m.mutex.lock()
    i = mg_find(m, size, s)
    if i >= 0:
        b = mg_remove(m, i)
        # Bytes in use were counted (the pool counts held blocks as in use); its credit,
        # if any, is spent, the rest joins the bound as a shared acquire would.
        spent = size if m.credit >= size else m.credit
        m.credit -= spent
        st.counters.in_use -= size
        st.counters.cached += size
        st.bound -= spent
    m.mutex.unlock()
    return b


cdef inline bint mp_flush_own(PoolState* st, Magazine* m, size_t size,
                              bint growing) noexcept nogil:
    """Under the pool's lock, for a request of size bytes of the calling thread: its held
    blocks go to the free lists, joined, but those a small request leaves (mp_keeps).
    growing: the pool grows for it next, and all the others go. Else the request found
    neither a held nor a free block of its exact size (the caller checks), and only those
    it could be cut from and those that MAG_AGE such requests have passed by go, so that
    a cut sees the free memory (blocks held while others are cut raised the recorded
    traces' peaks), while a thread cycling through a few sizes keeps them. Whether any
    went."""
    cdef bint dropped = False
    cdef int i
    if m == NULL or m.nblocks == 0:
        return False
    m.mutex.lock()
    if not growing:
        m.misses += 1
    i = m.nblocks
    while i:
        i -= 1
        if mp_keeps(m.blocks[i], size):
            continue
        if growing or m.blocks[i].size >= size or m.misses - m.since[i] > MAG_AGE:
            mp_drop(st, m, i)
            dropped = True
    m.mutex.unlock()
    return dropped


cdef inline bint mp_flush_mine(PoolState* st, Magazine* m) noexcept nogil:
    """Under the pool's lock: the calling thread's held blocks to the free lists; whether
    there were any."""
    if m == NULL or m.nblocks == 0:
        return False
    m.mutex.lock()
    mp_flush(st, m)
    m.mutex.unlock()
    return True


cdef inline bint mp_flush_idle(PoolState* st, Magazine* mine, StreamKey s) noexcept nogil:
    """Under the pool's lock, for a request on s that found no free block of its exact
    size: the blocks held on s by threads that made no request since the last such look
    go to the free lists, joined, so that the cut sees that free memory too (PyTorch's
    autograd thread allocates the backward while the main thread, waiting, holds what the
    forward freed, and the other way round); whether any went. Threads that allocate keep
    theirs: taking them would have threads on one stream empty each other's magazines at
    every miss."""
    cdef Magazine* m
    cdef bint dropped = False
    cdef size_t k
    st.sweeps[SWEEP_OTHERS] += 1
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        if m == mine or m.nblocks == 0:
            continue
        m.mutex.lock()
        if m.requests == m.seen:            # idle since the last look
            dropped = mp_drop_stream(st, m, s) or dropped
        m.seen = m.requests
        m.mutex.unlock()
    return dropped


cdef inline bint mp_reap(PoolState* st) noexcept nogil:
    """Under the pool's lock: the magazines of threads that exited go to the free lists and
    are deleted (those still listing C API blocks once these are freed). Returns whether
    any block moved."""
    return mp_sweep(st, True)


cdef inline void mp_want(PoolState* st, size_t size, StreamKey s) noexcept nogil:
    """Under the pool's lock, before the pool grows for size bytes on s: a block another
    thread holds that would fit, on another stream, makes that stream wanted, as a free
    block of it would (so_take): when it next allocates, its thread gives it up."""
    cdef Magazine* m
    cdef size_t k
    cdef int i
    st.sweeps[SWEEP_WANT] += 1
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        if m.nblocks == 0:
            continue
        m.mutex.lock()
        for i in range(m.nblocks):
            if m.blocks[i].size >= size and not same_stream(m.blocks[i].stream, s):
                so_mark_wanted(&st.order, m.blocks[i].stream)
        m.mutex.unlock()


cdef inline void mp_give_up(PoolState* st, Magazine* m, StreamKey s) noexcept nogil:
    """Under the pool's lock: stream s is wanted and allocating on the calling thread,
    whose blocks held on s go to the free lists (to get their events there)."""
    if m == NULL or m.nblocks == 0:
        return
    m.mutex.lock()
    mp_drop_stream(st, m, s)
    m.mutex.unlock()


cdef inline bint mp_drop_stream(PoolState* st, Magazine* m, StreamKey s) noexcept nogil:
    """Under the pool's lock and m's: m's blocks held on s to the free lists; whether any
    went."""
    cdef bint dropped = False
    cdef int i = m.nblocks
    while i:
        i -= 1
        if same_stream(m.blocks[i].stream, s):
            mp_drop(st, m, i)
            dropped = True
    return dropped


cdef inline void mp_hold(PoolState* st, Magazine* m, Block* b, StreamKey s) noexcept nogil:
    """Under m's lock: m holds b (room checked by the caller), its bytes credited."""
    b.stream = s
    b.holder = NULL
    b.used = st.counters.num_allocs   # last live now (sg_reclaim's cold blocks)
    b.state = HELD
    m.blocks[m.nblocks] = b
    m.since[m.nblocks] = m.misses
    m.nblocks += 1
    m.held += b.size
    m.credit += b.size
    m.frees += 1
    m.freed_bytes += b.size


cdef inline void mp_drop(PoolState* st, Magazine* m, int i) noexcept nogil:
    """Under the pool's lock and m's: held block i goes to the free lists (joined)."""
    cdef Block* b = mg_remove(m, i)
    cdef size_t spent = b.size if m.credit >= b.size else m.credit
    m.credit -= spent
    st.bound -= spent
    st.counters.in_use -= b.size
    st.counters.cached += b.size
    pk_put(st, b)


cdef inline Block* mp_find_handed(PoolState* st, uintptr_t ptr, bint remove) noexcept nogil:
    """Under the pool's lock: the block at ptr handed out by any thread's magazine
    through the C API (taken off its list if remove); NULL if none."""
    cdef Magazine* m
    cdef Block* b = NULL
    cdef size_t k
    cdef int i
    st.sweeps[SWEEP_HANDED] += 1
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        m.mutex.lock()
        i = mg_find_handed(m, ptr)
        if i >= 0:
            b = mg_unhand(m, i) if remove else m.handed[i]
        m.mutex.unlock()
        if b != NULL:
            return b
    return NULL


cdef inline void mp_flush(PoolState* st, Magazine* m) noexcept nogil:
    """Under the pool's lock and m's: every held block to the free lists, m's counts
    folded into the pool's counters."""
    while m.nblocks:
        mp_drop(st, m, m.nblocks - 1)
    mp_fold(st, m)


cdef inline void mp_fold(PoolState* st, Magazine* m) noexcept nogil:
    count_fast(&st.counters, m.allocs, m.allocated_bytes, m.frees, m.freed_bytes)
    m.allocs = m.frees = m.allocated_bytes = m.freed_bytes = 0


cdef inline bint mp_flush_all(PoolState* st) noexcept nogil:
    """Under the pool's lock: every thread's held blocks to the free lists; magazines
    of exited threads are deleted. Returns whether any block moved."""
    return mp_sweep(st, False)


cdef inline bint mp_sweep(PoolState* st, bint exited_only) noexcept nogil:
    """Flush every magazine (exited_only: those of exited threads, whose flag is set once,
    under its lock, by the thread's exit) and delete those of exited threads that list no
    C API block."""
    cdef Magazine* m
    cdef bint moved = False
    cdef size_t k = 0
    while k < st.magazines.size():
        m = st.magazines[k]
        if exited_only and not m.orphan:
            k += 1
            continue
        m.mutex.lock()
        moved = moved or m.nblocks > 0
        mp_flush(st, m)
        if m.orphan and m.nhanded == 0:
            m.mutex.unlock()
            del m
            st.magazines.erase(st.magazines.begin() + k)
            continue
        m.mutex.unlock()
        k += 1
    return moved


cdef inline void mp_hand_out(PoolState* st, Block* b, StreamKey s, bint grew) noexcept nogil:
    """Under the pool's lock: block b, cut for a request on s by the shared path, is live;
    a cache miss when the pool grew for it, else a hit."""
    b.state = LIVE
    b.stream = s
    if grew:
        st.counters.cache_misses += 1
    else:
        st.counters.cache_hits += 1


cdef inline void mp_count_taken(PoolState* st, size_t size) noexcept nogil:
    """Under the pool's lock: a block of size bytes handed out by the shared path."""
    count_acquired(&st.counters, size)
    st.bound += size
    if st.bound > st.counters.peak_in_use:
        mp_settle_peak(st)


cdef inline void mp_settle_peak(PoolState* st) noexcept nogil:
    """Under the pool's lock, when the bound passed the peak: take back credit, each
    magazine it takes from kept locked until the end, in the order that least has a
    thread short of it next: the credit of threads that made no request since the last
    settle, then other threads' credit beyond their largest held block (a retake of one
    block never needs it), then the most credit first. Once the bound is back at the
    peak, bytes in use (at most the bound) are too, at that moment, with the locked
    magazines still: no peak went by unseen, and the other threads' magazines were not
    stopped. If all the credit does not do, every magazine is locked by then: bytes in
    use, exactly, raise the peak, and the credit above it goes. (Richest first alone had
    8 threads cycling through 5 sizes take each other's credit at every turn.)"""
    cdef vector[pair[size_t, size_t]] order     # (credit, index), the most last
    cdef vector[char] locked
    cdef size_t k, j, n = st.magazines.size(), held = 0, in_use, spare, largest
    cdef size_t excess = st.bound - st.counters.peak_in_use     # > 0
    cdef Magazine* m
    st.sweeps[SWEEP_SETTLE] += 1
    locked.resize(n, 0)
    for k in range(n):                  # idle threads' credit (requests: a hint)
        m = st.magazines[k]
        if excess and m.credit and m.requests == m.settled:
            m.mutex.lock()
            locked[k] = 1
            excess = mp_take_credit(st, m, m.credit, excess)
    for k in range(n):                  # credit no single retake needs
        m = st.magazines[k]
        if excess and not locked[k] and m.credit:
            m.mutex.lock()
            locked[k] = 1
            largest = mg_largest(m)
            spare = m.credit - largest if m.credit > largest else 0
            excess = mp_take_credit(st, m, spare, excess)
    if excess:
        for k in range(n):
            order.push_back(pair[size_t, size_t](st.magazines[k].credit, k))  # a hint
        sort(order.begin(), order.end())
        j = n
        while j and excess:
            j -= 1
            k = order[j].second
            m = st.magazines[k]
            if not locked[k]:
                m.mutex.lock()
                locked[k] = 1
            excess = mp_take_credit(st, m, m.credit, excess)
        if excess:
            # Every magazine is locked, its credit gone: the bound is bytes in use,
            # exactly.
            for k in range(n):
                m = st.magazines[k]
                if not locked[k]:
                    m.mutex.lock()
                    locked[k] = 1
                mp_fold(st, m)
                held += m.held
            in_use = st.counters.in_use - held
            if in_use > st.counters.peak_in_use:
                st.counters.peak_in_use = in_use
    for k in range(n):
        m = st.magazines[k]
        m.settled = m.requests
        if locked[k]:
            m.mutex.unlock()


cdef inline size_t mp_take_credit(PoolState* st, Magazine* m, size_t most,
                                  size_t excess) noexcept nogil:
    """Under the pool's lock and m's: up to `most` of m's credit, and no more than
    excess, leaves the bound; the excess left."""
    cdef size_t back = excess if most >= excess else most
    m.credit -= back
    st.bound -= back
    return excess - back


cdef inline size_t mp_freeze(PoolState* st) noexcept nogil:
    """Under the pool's lock: lock every magazine, fold its counts; returns the bytes
    they hold. _thaw unlocks them."""
    cdef size_t k, held = 0
    cdef Magazine* m
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        m.mutex.lock()
        mp_fold(st, m)
        held += m.held
    return held


cdef inline void mp_thaw(PoolState* st) noexcept nogil:
    cdef size_t k
    for k in range(st.magazines.size()):
        st.magazines[k].mutex.unlock()


cdef inline Counters mp_counters_view(PoolState* st) noexcept nogil:
    """Under the pool's lock: the counters as they are, the magazines' blocks counted as
    cached and their fast path's counts included."""
    cdef size_t held = mp_freeze(st)
    cdef Counters c = st.counters
    mp_thaw(st)
    c.in_use -= held
    c.cached += held
    return c


cdef inline void mp_reset_peaks(PoolState* st) noexcept nogil:
    """Under the pool's lock: the peaks of bytes in use and reserved are the current
    values (bytes in use exactly: every magazine read, their credit taken back)."""
    cdef size_t k
    st.counters.peak_in_use = st.counters.in_use - mp_freeze(st)
    for k in range(st.magazines.size()):
        st.magazines[k].credit = 0       # the bound is bytes in use again
    st.bound = st.counters.peak_in_use
    mp_thaw(st)
    st.counters.peak_reserved = st.counters.reserved


cdef inline size_t mp_largest_held(PoolState* st) noexcept nogil:
    """Under the pool's lock: the largest block any thread's magazine holds."""
    cdef size_t k, largest = 0, size
    cdef Magazine* m
    for k in range(st.magazines.size()):
        m = st.magazines[k]
        m.mutex.lock()
        size = mg_largest(m)
        m.mutex.unlock()
        if size > largest:
            largest = size
    return largest
