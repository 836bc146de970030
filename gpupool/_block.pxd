# The pool's C-level records: blocks of device memory, the slabs small blocks are carved from,
# free lists binned by size class and stream, and a region's cache. Types only; the code that
# keeps them is in _pool.pyx.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from libcpp.pair cimport pair
from cpython.ref cimport PyObject

# A stream as the pool tells streams apart. The per-thread default stream has one handle value
# (CU_STREAM_PER_THREAD) that names another stream in every thread, so its tag is the thread;
# the legacy default stream is handle 0 (CU_STREAM_LEGACY is folded into it), tag 0. Any other
# stream's tag is the driver's stream ID (cuStreamGetId), unique for the process's lifetime:
# a handle value reused by a new stream after cuStreamDestroy gives another key.
cdef struct StreamKey:
    uintptr_t handle
    uintptr_t tag

cdef enum BlockState:
    LIVE = 1            # owned by a DeviceBuffer
    FREE_POOL = 2       # in the pool's free lists
    FREE_REGION = 3     # in a region's free lists

# One upstream allocation that small blocks of any size class are carved from, front to back,
# as they are first needed. Carved blocks keep their size class for the slab's lifetime.
cdef struct Slab:
    uintptr_t ptr
    size_t nbytes
    size_t carved           # bytes carved so far (the rest is free, counted as cached)
    size_t nblocks          # blocks carved
    size_t free_in_pool     # carved blocks now in the pool's free lists
    Block* blocks           # the carved blocks, linked through slab_next
    StreamKey stream        # stream-ordered upstreams: the stream the slab was allocated on,
    uintptr_t event         # and an event recorded there after it (0: none, or completed)

cdef struct Block:
    uintptr_t ptr
    uintptr_t rank                  # creation order in its pool: free lists hand out lowest first
    size_t size                     # bytes: its size class's, or more (see Pool._exact_block)
    int cls                         # size-class index: class_size(cls) <= size
    BlockState state
    Slab* slab                      # NULL: the block is its own upstream allocation
    Block* slab_next
    Block* seg_prev                 # address neighbours carved from the same upstream
    Block* seg_next                 # allocation by splitting (large blocks); NULL: none
    StreamKey stream                # stream of last use
    uintptr_t event                 # recorded on `stream` after its last use; 0: none yet
    vector[uintptr_t]* extra_events     # recorded at the free on streams added by record_stream
    vector[StreamKey]* extra_streams    # streams added with record_stream while live
    RegionCache* region             # the region the block returns to when freed; NULL: pool
    bint escaped                    # outlived an exit of its region: returns to the pool
    Block* live_prev                # the region's list of its live blocks
    Block* live_next
    PyObject* buffer                # the DeviceBuffer that owns it while live (borrowed)

# Free blocks of one (size class, stream), oldest block first: the same request sequence then
# gets the same blocks, in the order it first got them, whatever order they were freed in.
ctypedef pair[uintptr_t, Block*] HeapItem      # (~rank, block): std heaps are max-heaps

cdef cppclass StreamBin:
    StreamKey key
    vector[HeapItem] heap

cdef cppclass FreeLists:
    vector[vector[StreamBin]] bins      # by size class

cdef cppclass RegionCache:
    void* pool                  # the Pool it belongs to (borrowed; the Region keeps it alive)
    FreeLists free
    Block* live_head
    size_t live_count
    size_t live_bytes           # bytes of its live blocks: the region's bytes in use
    size_t escaped_bytes        # bytes of its blocks that outlived an exit and are still live
    size_t cached_bytes
    size_t peak_in_use_bytes
    size_t hits
    size_t misses
    size_t max_cached_bytes     # 0: no cap
    PyObject* on_alloc          # called with each new block's pointer (trace=True); borrowed

# Blocks handed out by the C API, which frees by pointer: an open-addressing table (linear
# probing, no allocation per entry). Keys are 256-byte aligned pointers, so 0 marks an empty
# slot and 1 a deleted one.
ctypedef pair[uintptr_t, Block*] PtrSlot

cdef cppclass PtrTable:
    vector[PtrSlot] slots
    size_t used             # slots not empty (live or deleted)
