# The records of device memory the core keeps: a block (one piece of memory handed out or
# cached) and a slab (one upstream allocation that small blocks are carved from). Types only:
# the free lists that hold free blocks are in _freelist.pxd, the code that makes, cuts and
# joins blocks in _segments.pxd, a region's bookkeeping of its blocks in _regioncache.pxd.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool._streams cimport StreamKey

cdef enum BlockState:
    LIVE = 1            # handed out (to a DeviceBuffer, the C API or an adapter)
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

# A block's place in its region (_regioncache.pxd keeps it; NULL cache: the pool's block).
cdef struct RegionLink:
    void* cache             # the RegionCache the block returns to when freed
    bint escaped            # outlived an exit of its region: returns to the pool
    Block* prev             # the region's list of its live blocks
    Block* next

cdef struct Block:
    uintptr_t ptr
    uintptr_t rank                  # creation order in its pool: free lists hand out lowest first
    size_t size                     # bytes: its size class's, or more (an exact block)
    int cls                         # size-class index: class_size(cls) <= size
    BlockState state
    Slab* slab                      # NULL: not carved from a slab
    Block* slab_next
    Block* seg_prev                 # address neighbours carved from the same upstream
    Block* seg_next                 # allocation by cutting (large blocks); NULL: none
    StreamKey stream                # stream of last use
    uintptr_t event                 # recorded on `stream` after its last use; 0: none yet
    vector[uintptr_t]* extra_events     # recorded at the free on streams added by record_stream
    vector[StreamKey]* extra_streams    # streams added with record_stream while live
    RegionLink region
    void* holder                    # while live: the DeviceBuffer that holds it (borrowed)
