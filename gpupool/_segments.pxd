# Segments: how the pool's memory is laid out in upstream allocations.
#
# * Blocks of classes up to SLAB_BLOCK_MAX are carved from shared slabs of SLAB_BYTES, so the
#   upstream is not called for every small allocation; a slab goes back only when all its
#   blocks are free (at a trim).
# * Outside regions, new blocks up to SEGMENT_FOR are cut from segments of up to SEGMENT_BYTES
#   (an eighth of the pool's reserved bytes at most), so that mid-sized blocks share upstream
#   allocations and their frees can join; larger blocks are upstream allocations of their own.
# * A cached block is cut to serve a smaller request (split); a freed piece joins its free
#   neighbours of the same upstream allocation on one stream (join), so pieces become one
#   block again; a trim gives an upstream allocation back once all of it is free.
# * Under a hard limit that a size class's rounding would cross, a block of the room left
#   serves (exact_block).
# Everything here runs under the pool's lock; the counters of reserved and cached bytes are
# kept here (Counters), the free lists the pieces go to are the pool's.
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from libcpp.vector cimport vector
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool._block cimport Block, Slab, LIVE, FREE_POOL
from gpupool._counters cimport Counters, count_reserved, count_returned
from gpupool._freelist cimport FreeLists, fl_put, fl_unbin, fl_take_all
from gpupool._sizes cimport SMALL_STEP, floor_class
from gpupool._streamorder cimport StreamOrder, so_drop_events, so_slab_event, so_rebin_unused
from gpupool._streams cimport StreamKey, same_stream, is_no_stream, no_stream
from gpupool._upstream cimport Upstream

cdef extern from *:
    """
    #define GP_SLAB_BYTES ((size_t)2 << 20)
    #define GP_SLAB_BLOCK_MAX ((size_t)256 << 10)
    #define GP_SPLIT_MIN ((size_t)1 << 20)
    #define GP_SEGMENT_FOR ((size_t)10 << 20)
    #define GP_SEGMENT_BYTES ((size_t)20 << 20)
    #define GP_SEGMENT_STEP ((size_t)2 << 20)
    """
    size_t SLAB_BYTES "GP_SLAB_BYTES"           # bytes of a slab
    size_t SLAB_BLOCK_MAX "GP_SLAB_BLOCK_MAX"   # larger blocks are not carved from slabs
    size_t SPLIT_MIN "GP_SPLIT_MIN"             # a cached large block is cut if this is left
    size_t SEGMENT_FOR "GP_SEGMENT_FOR"         # a new block up to this size is cut from a
    size_t SEGMENT_BYTES "GP_SEGMENT_BYTES"     # segment of at most this size,
    size_t SEGMENT_STEP "GP_SEGMENT_STEP"       # in steps of this size

cdef enum:
    SEGMENT_SHARE = 8           # a segment is at most this share of the pool's reserved bytes

cdef cppclass Segments:
    Slab* slab                  # the slab small blocks are carved from now
    uintptr_t ranks             # blocks created so far (a block's rank is its creation order)
    size_t hard_limit           # bytes the pool may reserve; 0: no limit


cdef inline Block* sg_new_record(Segments* sg, uintptr_t ptr, size_t size, int cls) noexcept nogil:
    """A zeroed block record of the next rank, never used on any stream; NULL when the host
    has no memory."""
    cdef Block* b = <Block*>calloc(1, sizeof(Block))
    if b == NULL:
        return NULL
    b.ptr, b.size, b.cls, b.stream = ptr, size, cls, no_stream()
    b.rank = sg.ranks
    sg.ranks += 1
    return b


cdef inline int sg_upstream_alloc(Segments* sg, Upstream up, Counters* c, size_t nbytes,
                                  StreamKey s, uintptr_t* ptr) noexcept nogil:
    """nbytes from the upstream for work on s, within the hard limit; counted as cached."""
    cdef int r
    if sg.hard_limit and c.reserved + nbytes > sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    r = up.alloc(nbytes, s.handle, ptr)
    if r == 0:
        count_reserved(c, nbytes)
    return r


cdef inline void sg_upstream_free(Upstream up, Counters* c, uintptr_t ptr,
                                  size_t nbytes) noexcept nogil:
    up.free(ptr)
    count_returned(c, nbytes)


cdef inline int sg_carve(Segments* sg, Upstream up, Counters* c, StreamOrder* so, int cls,
                         size_t size, StreamKey s, Block** out) noexcept nogil:
    """Carve a block from the current slab, starting a new slab when it is full."""
    cdef Slab* slab = sg.slab
    cdef uintptr_t ptr = 0
    cdef Block* b
    cdef int r
    if slab == NULL or slab.nbytes - slab.carved < size:
        r = sg_upstream_alloc(sg, up, c, SLAB_BYTES, s, &ptr)
        if r != 0:
            return r
        slab = <Slab*>calloc(1, sizeof(Slab))
        if slab == NULL:
            sg_upstream_free(up, c, ptr, SLAB_BYTES)
            return CUDA_ERROR_OUT_OF_MEMORY
        slab.ptr, slab.nbytes, slab.stream = ptr, SLAB_BYTES, s
        sg.slab = slab
        if up.stream_ordered:
            # The memory exists in s's order only: other streams wait for this event.
            r = so_slab_event(so, up, slab)
            if r != 0:
                return r
    elif slab.event and not same_stream(slab.stream, s):
        if up.event_query(slab.event) == 0:
            so.events.push_back(slab.event)
            slab.event = 0
        else:
            r = up.stream_wait(s.handle, slab.event)
            if r != 0:
                return r
    b = sg_new_record(sg, slab.ptr + slab.carved, size, cls)
    if b == NULL:
        return CUDA_ERROR_OUT_OF_MEMORY
    b.slab = slab
    b.slab_next = slab.blocks
    slab.blocks = b
    slab.carved += size
    slab.nblocks += 1
    out[0] = b
    return 0


cdef inline int sg_new_block(Segments* sg, Upstream up, Counters* c, int cls, size_t size,
                             StreamKey s, Block** out) noexcept nogil:
    """A block that is an upstream allocation of its own."""
    cdef uintptr_t ptr = 0
    cdef int r = sg_upstream_alloc(sg, up, c, size, s, &ptr)
    cdef Block* b
    if r != 0:
        return r
    b = sg_new_record(sg, ptr, size, cls)
    if b == NULL:
        sg_upstream_free(up, c, ptr, size)
        return CUDA_ERROR_OUT_OF_MEMORY
    out[0] = b
    return 0


cdef inline size_t sg_segment_bytes(Counters* c) noexcept nogil:
    """Bytes of the segment a new mid-sized block is cut from: an eighth of what the pool
    reserves, in SEGMENT_STEP steps, at most SEGMENT_BYTES; so the unused end of the latest
    segment stays a small share of the pool."""
    cdef size_t seg = (c.reserved // SEGMENT_SHARE) & ~(SEGMENT_STEP - 1)
    return seg if seg < SEGMENT_BYTES else SEGMENT_BYTES


cdef inline int sg_exact_block(Segments* sg, Upstream up, Counters* c, size_t nbytes,
                               StreamKey s, Block** out) noexcept nogil:
    """Under a hard limit that the size class's rounding would cross: a block of the room
    left (>= nbytes), binned in the largest class it holds. A pool capped at N bytes can so
    always allocate one N-byte block once its cache is released."""
    cdef size_t room, size
    if c.reserved >= sg.hard_limit:
        return CUDA_ERROR_OUT_OF_MEMORY
    room = sg.hard_limit - c.reserved
    size = room - room % SMALL_STEP
    if size < nbytes:
        size = room
    if size < nbytes or size < SMALL_STEP:
        return CUDA_ERROR_OUT_OF_MEMORY
    return sg_new_block(sg, up, c, floor_class(size), size, s, out)


cdef inline bint sg_joinable(Block* a, Block* b) noexcept nogil:
    """Whether free neighbour b may join free block a: b is in the pool's free lists, neither
    waits on record_stream events, and they are free on one stream (or one was never used)."""
    return (b.state == FREE_POOL and a.extra_events == NULL and b.extra_events == NULL
            and (same_stream(a.stream, b.stream) or is_no_stream(a.stream)
                 or is_no_stream(b.stream)))


cdef inline void sg_join(StreamOrder* so, Block* a, Block* b) noexcept nogil:
    """a, free, takes in its free right neighbour b (out of the free lists): one block on
    their stream. Two blocks of one stream drop their events: the one recorded when the block
    is next wanted elsewhere covers both."""
    if is_no_stream(a.stream):
        a.stream = b.stream
        a.event, b.event = b.event, a.event
    elif not is_no_stream(b.stream):
        so_drop_events(so, a)
    so_drop_events(so, b)
    a.size += b.size
    a.seg_next = b.seg_next
    if b.seg_next != NULL:
        b.seg_next.seg_prev = a
    free(b)


cdef inline void sg_put(StreamOrder* so, FreeLists* fl, Block* b) noexcept nogil:
    """Put a free block (state FREE_POOL) into the pool's free lists fl, joined first with
    its free neighbours of the same upstream allocation."""
    cdef Block* n = b.seg_prev
    if n != NULL or b.seg_next != NULL:
        if n != NULL and sg_joinable(b, n):
            fl_unbin(fl, n)
            sg_join(so, n, b)
            b = n
        n = b.seg_next
        if n != NULL and sg_joinable(b, n):
            fl_unbin(fl, n)
            sg_join(so, b, n)
        b.cls = floor_class(b.size)
    fl_put(fl, b)


cdef inline void sg_split(Segments* sg, StreamOrder* so, FreeLists* fl, Block* b, int cls,
                          size_t size, StreamKey s) noexcept nogil:
    """Cut a block just taken for stream s (its earlier work is ordered before s's next) to
    size; the rest becomes a cached block of the pool (in fl), free on s."""
    cdef Block* rest = sg_new_record(sg, b.ptr + size, b.size - size, 0)
    if rest == NULL:
        return                          # no host memory: the block serves whole
    rest.cls = floor_class(rest.size)
    if not is_no_stream(b.stream):
        rest.stream = s
    rest.seg_prev, rest.seg_next = b, b.seg_next
    if b.seg_next != NULL:
        b.seg_next.seg_prev = rest
    b.seg_next = rest
    b.size, b.cls = size, cls
    b.state = LIVE                      # not joinable with rest
    rest.state = FREE_POOL
    sg_put(so, fl, rest)


cdef inline void sg_join_pieces(StreamOrder* so, vector[Block*]* pieces, vector[Block*]* keep,
                                vector[Block*]* whole) noexcept nogil:
    """During a trim, after every event has completed and with the free lists emptied: join
    each run of free neighbouring pieces into its first; a run that is a whole upstream
    allocation goes to whole, any other to keep."""
    cdef vector[Block*] firsts
    cdef size_t i
    cdef Block* b
    for i in range(pieces.size()):
        b = pieces[0][i]
        so_drop_events(so, b)
        b.stream = no_stream()
        if b.seg_prev == NULL or b.seg_prev.state != FREE_POOL:
            firsts.push_back(b)         # the others are joined into these (and freed)
    for i in range(firsts.size()):
        b = firsts[i]
        while b.seg_next != NULL and b.seg_next.state == FREE_POOL:
            sg_join(so, b, b.seg_next)
        if b.seg_prev == NULL and b.seg_next == NULL:
            whole.push_back(b)
        else:
            b.cls = floor_class(b.size)
            keep.push_back(b)


cdef inline size_t sg_trim(Segments* sg, Upstream up, Counters* c, StreamOrder* so,
                           FreeLists* fl) noexcept nogil:
    """Give the free blocks of fl (the pool's), wholly free slabs and wholly free upstream
    allocations of pieces back to the upstream; returns the bytes given back. Synchronizes
    the device first when a free block may still be in use by queued work; what stays cached
    is then free for any stream."""
    cdef vector[Block*] blocks, keep, large, pieces
    cdef vector[Slab*] slabs
    cdef size_t i, before = c.reserved
    cdef Block* b
    cdef Block* nxt
    cdef bint busy = False
    fl_take_all(fl, &blocks)
    for i in range(blocks.size()):
        b = blocks[i]
        busy = busy or not is_no_stream(b.stream)
        if b.seg_prev != NULL or b.seg_next != NULL:
            pieces.push_back(b)
        elif b.slab == NULL:
            large.push_back(b)
        elif b.slab.free_in_pool == b.slab.nblocks:
            if b == b.slab.blocks:
                slabs.push_back(b.slab)
        else:
            keep.push_back(b)
    if busy:
        # Cached blocks may still be read by work queued before their free. After this every
        # event has completed, so every kept block is free for any stream.
        up.synchronize()
        so.wanted.clear()
    sg_join_pieces(so, &pieces, &keep, &large)
    so_rebin_unused(so, fl, &keep, NULL)
    for i in range(large.size()):
        so_drop_events(so, large[i])
        sg_upstream_free(up, c, large[i].ptr, large[i].size)
        free(large[i])
    for i in range(slabs.size()):
        if slabs[i] == sg.slab:
            sg.slab = NULL
        if slabs[i].event:
            so.events.push_back(slabs[i].event)
        b = slabs[i].blocks
        while b != NULL:
            nxt = b.slab_next
            so_drop_events(so, b)
            free(b)
            b = nxt
        sg_upstream_free(up, c, slabs[i].ptr, slabs[i].nbytes)
        free(slabs[i])
    return before - c.reserved
