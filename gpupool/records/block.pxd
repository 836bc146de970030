# The records of device memory the core keeps: a segment (one upstream allocation, or one
# expandable address range whose pages are mapped as it grows) and the blocks that tile it
# (pieces handed out, free, or, in an expandable segment, unmapped). Types only: the free
# lists that hold free blocks are in core/freelist.pxd, the code that makes, cuts, joins and
# unmaps blocks in core/segments.pxd, a region's bookkeeping of its blocks in core/regioncache.pxd.
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector
from gpupool.records.ipcslot cimport gp_ipc_slot
from gpupool.records.streams cimport StreamKey

cdef enum BlockState:
    RETIRED = 0         # in no segment's tiling: a spare record (core/cutjoin.pxd's sg_retire)
    LIVE = 1            # handed out (to a DeviceBuffer, the C API or an adapter)
    FREE = 2            # in the pool's free lists
    UNMAPPED = 3        # an expandable segment's pages given back: no memory behind it
    PARKED = 4          # freed last, held aside unjoined for a request of its exact size
    HELD = 5            # in a thread's magazine (core/magazine.pxd): free, not in the free lists
    TAGGED = 6          # free in a tag's segment (core/tagged.pxd): not in the free lists

# Host memory holding offloaded bytes (core/offload.pxd): a sleeping tag's, or the page-locked
# chunk the pool keeps for the next offload.
cdef struct HostChunk:
    uintptr_t ptr       # 0: none
    size_t nbytes
    bint pinned         # the upstream's page-locked memory (host_alloc); else malloc's

cdef struct Segment:
    uintptr_t base
    size_t nbytes       # bytes of memory it holds: allocated, or mapped from base on
    size_t va_bytes     # expandable: bytes of its range (address space); 0: an allocation
    StreamKey stream    # expandable: the stream it grows for
    Block* first        # its blocks tile [base, base + nbytes), linked by seg_next
    Block* last
    Segment* next       # the pool's segments
    gp_ipc_slot* ipc    # its CUDA IPC export slot (ipc/share.pyx); NULL: never exported
    int tag             # a tag's segment (core/tagged.pxd): the tag's id; 0: none
    bint asleep         # a tag's segment whose pages are unmapped (Pool.sleep)
    HostChunk offload   # asleep with offload: its live blocks' bytes in host memory; ptr 0: none

# A block's place in its region (core/regioncache.pxd keeps it). While the block is live: the
# region it was allocated in and returns to, and that region's list of live blocks. While it
# is free: the region that caches it (NULL: the pool), that region's list of cached blocks,
# and the region entry that last used it.
cdef struct RegionLink:
    void* cache
    bint escaped        # live: outlived an exit of its region, so it returns to the pool
    size_t stamp        # free: the entry of its region that last used it; live: that allocated it
    size_t place        # live: 1 + its request in its region's plan (core/planned.pxd); 0: none
    Block* prev
    Block* next

cdef struct Block:
    uintptr_t ptr
    size_t size                     # bytes (a multiple of 512)
    int cls                         # free: the size class it is binned in
    BlockState state
    int tag                         # its segment's tag (core/tagged.pxd); 0: untagged
    Segment* segment
    Block* seg_prev                 # address neighbours in its segment; NULL: none
    Block* seg_next
    StreamKey stream                # stream of last use
    uintptr_t event                 # recorded on `stream` after its last use; 0: none yet
    vector[uintptr_t]* extra_events     # recorded at the free on streams added by record_stream
    vector[StreamKey]* extra_streams    # streams added with record_stream while live
    RegionLink region
    void* holder                    # live: the DeviceBuffer that holds it (borrowed)
    size_t used                     # the pool's allocation count when it was last live
