# Magazines: a per-thread cache of freed blocks in front of the pool's shared free lists, as in
# Bonwick's slab allocator and mimalloc. A thread's free of a pool block (no region, no
# record_stream use, at most MAG_MAX bytes) goes into its magazine for that pool, and its next
# request of that exact size on the same stream is served from there, without the pool's lock: the
# magazine has a lock of its own, which only its thread takes on that path (one uncontended
# compare-and-swap, and a plain store to give it back), so threads do not meet on the
# pool's lock. Should a sweep of the pool (below) hold it just then, the thread waits for
# that: the shared path would wait for the same sweeper's pool lock (core/pool.pyx, _mag_wait).
#
# Whatever reaches across threads takes the pool's lock and then each magazine's (the only
# order: pool, then magazine) and flushes it into the free lists: trims, stream merges,
# statistics (which read every magazine), and the out of memory path: when the upstream has no
# memory for a request, every thread's held blocks go to the free lists before the ladder, so
# a block one thread holds serves another's request first. Before then they stay with their
# threads (a request that finds no free block grows the pool, as tcmalloc's thread caches do:
# taking them would have threads that use them steal each other's blocks at every miss), but
# for a thread that made no request since the last miss of another thread looked: a request
# that finds no free block of its exact size takes in such an idle thread's blocks held on
# its stream, so that the cut sees them (PyTorch's main thread waits in backward() holding
# what the forward freed while its autograd thread allocates: core/pool.pyx, _mag_flush_others).
# The calling thread's own held blocks go back before the pool grows for it, and, when a
# request of it finds no free block of its exact size, those it could serve cut and those two
# such requests have passed by (so that a cut sees the free memory, while a thread cycling
# through a few sizes keeps them); but a small request (up to 1 MiB) leaves a held block of 8
# times its size or more, and the pool grows for it instead (a page at most on an expandable
# upstream, a new segment on a plain one): a thread cycling
# through small and large sizes on one expandable segment would otherwise cut and join at
# every request (core/pool.pyx, _mag_keeps). A stream another stream waits for gives its thread's
# held blocks up the next time it allocates (so that they get their events:
# core/streamorder.pxd); regions' blocks, blocks used on other streams (record_stream) and, while
# the memory history records, every block take the shared path.
#
# Counting. The pool's counters count a magazine's blocks as in use (the shared path does not
# see the magazine), the magazine counts them as held: bytes in use are the counters' less
# every magazine's held bytes, cached bytes the counters' plus them. The peak of bytes in use
# stays exact through credit: `credit` bytes a thread may retake from its magazine without
# asking the pool. A free into the magazine adds its bytes to the thread's credit, a retake
# spends them, so in use plus all credit (the pool's `bound`) changes only on the shared path,
# under the pool's lock; the pool keeps bound <= peak, so a retake within credit can never
# pass the peak. When a shared acquire would lift bound above the peak, the pool takes back
# credit (idle threads' first, then what no retake of one block needs, then the most:
# core/pool.pyx, _settle_peak); if all of it does not do, it locks every magazine, computes bytes
# in use exactly and raises the peak to that. A retake beyond credit goes the shared way.
#
# The C API frees by pointer: the blocks a thread took from its magazine through it are listed
# in `handed`, so that thread's free finds them without the pool's table; a free of one on
# another thread finds it there under the magazine's lock.
from libc.stdint cimport uintptr_t
from gpupool.records.block cimport Block
from gpupool.records.streams cimport StreamKey, same_stream

cdef extern from "gp_lock.h" nogil:
    cppclass gp_lock:           # the pool's: one compare-and-swap when free, then a futex
        void lock()
        bint try_lock()
        void unlock()

cdef extern from "gp_magazine.h" nogil:
    cppclass gp_spin:           # a magazine's: compare-and-swap, release store; spins
        void lock()
        bint try_lock()
        bint try_lock_spin(unsigned spins)
        void unlock()

cdef enum:
    MAG_SLOTS = 8               # free blocks a magazine holds (the oldest goes when full)
    MAG_HANDED = 16             # C API blocks taken from it and not yet freed

cdef cppclass Magazine:
    char _pad_front[64]         # no cache line shared with a neighbour on the heap: each
    gp_spin mutex               # thread writes its own magazine on every call
    void* pool                  # NULL once the pool is gone (the thread then deletes it)
    bint orphan                 # its thread exited (the pool deletes it)
    Block* blocks[MAG_SLOTS]    # state HELD, oldest first
    size_t since[MAG_SLOTS]     # `misses` when each was held
    int nblocks
    size_t misses               # requests of its thread that it could not serve
    size_t requests             # requests of its thread that looked in it (its thread's count)
    size_t seen                 # `requests` when another thread's miss last looked (the pool's)
    size_t settled              # `requests` at the pool's last settle of the peak (the pool's)
    Block* handed[MAG_HANDED]   # live, taken through the C API from this magazine
    int nhanded
    size_t held                 # bytes of `blocks`
    size_t credit               # bytes it may retake without the pool (see above)
    # Counts of its fast path, folded into the pool's counters when they are read.
    size_t allocs
    size_t frees
    size_t allocated_bytes
    size_t freed_bytes
    # Why its thread's requests took the shared path while it held blocks (diagnostics, not
    # folded): other streams' blocks wanted, no held block of the size on the stream, or one
    # but too little credit.
    size_t wanted
    size_t no_block
    size_t no_credit
    size_t no_hand              # one, within credit, but MAG_HANDED C API blocks out
    # A request took the shared path with no block held (`empty`); a request (`waits`) or a
    # free (`free_waits`) found the lock another thread's, a sweep of the pool's, and waited.
    size_t empty
    size_t waits
    size_t free_waits
    char _pad_back[64]


cdef inline int mg_find(Magazine* m, size_t size, StreamKey s) noexcept nogil:
    """Index of the held block of exactly size bytes last used on s, at the lowest address
    (as best fit would choose among equals); -1 if none."""
    cdef int i, found = -1
    cdef Block* b
    for i in range(m.nblocks):
        b = m.blocks[i]
        if b.size == size and same_stream(b.stream, s) and \
                (found < 0 or b.ptr < m.blocks[found].ptr):
            found = i
    return found


cdef inline size_t mg_largest(Magazine* m) noexcept nogil:
    """Bytes of m's largest held block (0: none)."""
    cdef size_t largest = 0
    cdef int i
    for i in range(m.nblocks):
        if m.blocks[i].size > largest:
            largest = m.blocks[i].size
    return largest


cdef inline Block* mg_remove(Magazine* m, int i) noexcept nogil:
    """Take held block i out (its bytes leave `held`; credit is the caller's)."""
    cdef Block* b = m.blocks[i]
    cdef int j
    for j in range(i, m.nblocks - 1):
        m.blocks[j] = m.blocks[j + 1]
        m.since[j] = m.since[j + 1]
    m.nblocks -= 1
    m.held -= b.size
    return b


cdef inline int mg_find_handed(Magazine* m, uintptr_t ptr) noexcept nogil:
    """Index of the handed block at ptr, -1 if none (the newest first: frees come soon)."""
    cdef int i = m.nhanded
    while i:
        i -= 1
        if m.handed[i].ptr == ptr:
            return i
    return -1


cdef inline Block* mg_unhand(Magazine* m, int i) noexcept nogil:
    cdef Block* b = m.handed[i]
    m.nhanded -= 1
    m.handed[i] = m.handed[m.nhanded]
    return b
