# The pool's state: every record the pool's nogil functions (segments, stream order, free lists,
# parking, magazines, the out-of-memory ladder) read and write, in one struct, so that each
# takes one PoolState* instead of a pointer per part. Pool (core/pool.pxd) holds one.
#
# The upstream is not in the struct: it is a cdef class object, whose methods are called
# through its vtable; a typed `Upstream` argument costs nothing (it is a pointer in a
# register), while a borrowed PyObject* field would be cast back at every use (a reference
# count and a type the compiler no longer checks). So the functions that call the upstream
# take it as a second argument.
#
# NOTE: every field but the fast path's (see below) is read and written under the pool's lock
# (`mutex`, held by the thread `lock_thread`); a magazine's fields under its own lock too (order:
# the pool's, then the magazine's).
from libc.stdint cimport uintptr_t, uint32_t
from libcpp.vector cimport vector
from gpupool.records.block cimport Block, Segment
from gpupool.records.counters cimport Counters
from gpupool.records.ptrtable cimport PtrTable
from gpupool.records.streams cimport StreamKey
from gpupool.core.freelist cimport FreeLists
from gpupool.core.magazine cimport Magazine, gp_lock
from gpupool.core.regioncache cimport RegionCache

cdef enum:
    WANTED_FAST = 64            # wanted streams the fast path tells exactly (more: the mask)
    PARK_SLOTS = 8              # freed blocks held aside for a request of their exact size

cdef enum:                      # the pool's sweeps over every magazine, counted (sweeps)
    SWEEP_OTHERS = 0            # mp_flush_idle: a request's miss looks at idle threads'
    SWEEP_WANT                  # mp_want: before the pool grows
    SWEEP_HANDED                # mp_find_handed: a C API free not found in its table
    SWEEP_SETTLE                # mp_settle_peak: the bound passed the peak
    SWEEPS

cdef cppclass StreamOrder:
    vector[uintptr_t] events    # recycled events (created on the pool's device)
    vector[StreamKey] wanted    # streams whose free blocks another stream waits for

cdef cppclass Segments:
    Segment* head               # every segment of the pool
    vector[Block*] spare        # block records to reuse (cutting and joining allocate none)
    size_t hard_limit           # bytes the pool may reserve; 0: no limit, else >= BLOCK_ALIGN
    int* recording              # the memory history's switch (core/pool.pyx's copy)
    int device                  # the pool's device and id, for the memory history
    uint32_t pool_id

cdef cppclass PoolState:
    gp_lock mutex               # the pool's lock: an atomic word, one compare-and-swap when free
    uintptr_t lock_thread       # thread holding mutex, 0 when free
    vector[Block*] deferred     # frees made by lock_thread while it held the lock
    vector[RegionCache*] dropped    # regions dropped by lock_thread while it held it
    FreeLists free
    StreamOrder order
    Segments segments
    Block* parked[PARK_SLOTS]   # the blocks freed last, oldest first (PARKED)
    int nparked
    vector[RegionCache*] regions    # caches of this pool's regions, for the ladder
    vector[RegionCache*] lanes      # those of them with a lane (core/lane.pxd)
    RegionCache* last_region    # the region entered last (NULL: none, or dropped since) and
    uintptr_t last_thread       # its thread, for core/turns.pxd
    PtrTable capi_blocks        # blocks handed out by the C API, by pointer
    Counters counters           # a magazine's blocks count as in use (core/magazine.pxd)
    vector[Magazine*] magazines     # every thread's magazine for this pool
    size_t bound                # bytes in use plus every magazine's credit
    # What every thread's fast path (the magazines) reads without the pool's lock, on cache
    # lines of their own, off those the shared path writes (the bound, the counters): a
    # locked request does not take them from the other threads' caches.
    char pad_hot[64]
    RegionCache* process_region     # entered with scope="process": covers every thread
    # The wanted streams (core/streamorder.pxd) as the fast path reads them, without the lock
    # (copied at each unlock): their threads take the shared path, which answers them. The
    # mask has each one's bit (wanted_bit): a stream whose bit is clear is not wanted, at one
    # load; one whose bit is set is looked for in the list.
    unsigned long long wanted_mask
    int nwanted                 # WANTED_FAST + 1: more than WANTED_FAST (the mask)
    StreamKey wanted[WANTED_FAST]
    char pad_cold[64]
    size_t soft_limit           # 0: none
    vector[StreamKey] tag_waits     # streams whose capture kept tagged blocks from a device
                                    # synchronize (tg_free; none: none waits; tg_reorder)
    size_t sweeps[SWEEPS]       # diagnostics (Pool._sweep_counts)
