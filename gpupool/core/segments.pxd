# Segments: how the pool's memory is laid out (records/block.pxd: a segment is tiled by its
# blocks, in address order), and the constants of its growth. The operations on segments are
# one file each:
#
# * core/cutjoin.pxd: a request is rounded to 512 bytes and served by best fit from the free
#   lists; a free block larger than the request is cut (sg_split) and the rest stays free. On
#   an expandable upstream a small request (at most 1 MiB) without a near-exact fit goes just
#   below a live small block, cut from the top of the free block there (so_take_small,
#   sg_split_top). A freed block joins its free neighbours in its segment (sg_put), so pieces
#   become one block again.
# * core/growplain.pxd: growth on a plain upstream ("driver", "async"): a new segment of the
#   request rounded up to the 2 MiB page (the driver maps whole pages anyway), or, for requests
#   up to SEGMENT_FOR, of up to SEGMENT_BYTES (an eighth of the pool's reserved bytes at most),
#   so that small and mid-sized blocks share segments and their frees can join. Under a hard
#   limit that the rounding would cross, the exact rounded request. A growth past twice the
#   peak in use first gives back wholly free segments too small for the request (sg_shed).
# * core/growexpand.pxd: growth on an expandable upstream ("vmm"): each stream has a segment, a
#   range of address space set aside once, whose pages are mapped as it grows, so free space at
#   its end joins the next request instead of fragmenting (sg_extend). A hole that a trim
#   unmapped is mapped again first when it and its free neighbours fit the request. Before it
#   grows, the pages of cold free blocks move to the growth when they cover it (sg_reclaim):
#   reserved bytes do not grow for memory the pool holds in pieces too small for the request.
# * core/giveback.pxd: a trim (sg_trim), after the device's work is done: plain segments wholly
#   free go back to the upstream; in expandable segments every whole free page is unmapped. A
#   plain segment whose CUDA IPC handle another process holds open stays (sg_imported): freeing
#   memory an importer has mapped is undefined behaviour in CUDA IPC (ipc/share.pyx).
#
# Everything there runs under the pool's lock and takes the pool's state (core/state.pxd); the
# counters of reserved and cached bytes are kept there (Counters); region tags of free blocks
# are kept with core/regioncache.pxd's functions; each segment event (growth, mapping,
# unmapping, giving back) is noted for the memory history (sg_note, history/ring.pxd).
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from gpupool.records.block cimport Block, Segment, LIVE
from gpupool.history.ring cimport HistAction, hist_segment
from gpupool.core.state cimport Segments
from gpupool.records.streams cimport StreamKey

cdef extern from *:
    """
    #define GP_PAGE_BYTES ((size_t)2 << 20)
    #define GP_SEGMENT_FOR ((size_t)10 << 20)
    #define GP_SEGMENT_BYTES ((size_t)20 << 20)
    """
    size_t PAGE_BYTES "GP_PAGE_BYTES"           # the driver's page: growth is rounded to it
    size_t SEGMENT_FOR "GP_SEGMENT_FOR"         # a request up to this size grows a segment
    size_t SEGMENT_BYTES "GP_SEGMENT_BYTES"     # of at most this size

cdef enum:
    BLOCK_ALIGN = 512           # requests are rounded to this; no block is smaller
    SEGMENT_SHARE = 8           # a shared segment is at most this share of reserved bytes
    COLD_ALLOCS = 128           # a free block untouched by this many allocations is cold


cdef inline void sg_note(Segments* sg, HistAction action, uintptr_t addr, size_t nbytes,
                         StreamKey s) noexcept nogil:
    """A segment event, for the memory history while it records."""
    if sg.recording[0]:
        hist_segment(sg.device, sg.pool_id, action, addr, nbytes, s.handle)


cdef inline size_t round_up(size_t n, size_t step) noexcept nogil:
    return (n + step - 1) // step * step


cdef inline size_t round_request(size_t nbytes) noexcept nogil:
    """The bytes a request of nbytes takes: rounded up to 512 (at most 511 more)."""
    return round_up(nbytes, BLOCK_ALIGN)


cdef inline Segment* sg_new_segment(Segments* sg, uintptr_t base, size_t nbytes,
                                    size_t va_bytes, StreamKey s) noexcept nogil:
    cdef Segment* seg = <Segment*>calloc(1, sizeof(Segment))
    if seg == NULL:
        return NULL
    seg.base, seg.nbytes, seg.va_bytes, seg.stream = base, nbytes, va_bytes, s
    seg.next = sg.head
    sg.head = seg
    return seg


cdef inline void sg_drop_segment(Segments* sg, Segment* seg) noexcept nogil:
    cdef Segment** p = &sg.head
    while p[0] != NULL and p[0] != seg:
        p = &p[0].next
    if p[0] == seg:
        p[0] = seg.next
    free(seg)


cdef inline Block* sg_find_live(Segments* sg, uintptr_t ptr, size_t nbytes) noexcept nogil:
    """The live block holding [ptr, ptr + nbytes), or NULL (a walk of every segment)."""
    cdef Segment* seg = sg.head
    cdef Block* b
    while seg != NULL:
        if seg.base <= ptr < seg.base + (seg.va_bytes if seg.va_bytes else seg.nbytes):
            b = seg.first
            while b != NULL:
                if b.ptr <= ptr and ptr + nbytes <= b.ptr + b.size:
                    return b if b.state == LIVE else NULL
                b = b.seg_next
        seg = seg.next
    return NULL
