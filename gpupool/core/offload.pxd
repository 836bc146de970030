# Offload (docs/design.md, Note [Sleep and wake]): a sleeping tag's live bytes kept in host
# memory. One page-locked chunk of the upstream's (host_alloc) holds them, copied in runs of
# adjacent live blocks, each copy queued without a wait and the device synchronized once; after
# wake the chunk stays with the pool (the spare) for the next sleep, so a steady cycle pins
# nothing. Where the upstream has no page-locked memory (or refuses it), one bytearray a run.
# Under the pool's lock.
from libc.stdint cimport uintptr_t
from cpython.bytearray cimport PyByteArray_AS_STRING
from gpupool.records.block cimport Block, Segment, LIVE
from gpupool.records.counters cimport Counters
from gpupool.upstream.base cimport Upstream, DEVICE_TO_HOST, DEVICE_TO_PINNED

cdef struct HostChunk:
    uintptr_t ptr               # host_alloc's memory; 0: none
    size_t nbytes


cdef inline void of_free(Upstream up, HostChunk* chunk, Counters* c):
    """Give chunk back to the upstream (host_free) and empty it; the pool holds it no more
    either way (a refused host_free leaves it with the upstream)."""
    if chunk.ptr == 0:
        return
    if up.host_free(chunk.ptr) != 0:
        up.clear_error()
    c.pinned -= chunk.nbytes
    chunk.ptr, chunk.nbytes = 0, 0


cdef inline void of_keep(Upstream up, HostChunk* spare, Counters* c, list held):
    """Take back the host memory of_copy_out gave to held (a wake's, or a failed sleep's):
    its page-locked chunk becomes the spare, the larger of the two kept and the other given
    back; bytearrays go with the list."""
    cdef HostChunk chunk
    for item in held:
        if type(item) is tuple:
            chunk.ptr, chunk.nbytes = item
            if chunk.nbytes > spare.nbytes:
                of_free(up, spare, c)
                spare[0] = chunk
            else:
                of_free(up, &chunk, c)
    held.clear()


cdef inline int of_copy_out(Upstream up, Segment* seg, HostChunk* spare, Counters* c,
                            list held, list copies) except? -1:
    """Copy the live blocks of seg to host memory: into the spare chunk when it holds them
    all, else into a new chunk of their size (the spare given back first), else (none to be
    had) into bytearrays. Each run of adjacent live blocks is one copy, queued without a
    wait; then one synchronize. copies gets (device pointer, host address, bytes) per run,
    held what keeps the host memory ((pointer, bytes) of the chunk, or the bytearrays).
    Returns a status code."""
    cdef Block* b = seg.first
    cdef Block* end
    cdef size_t total = 0, run
    cdef HostChunk chunk
    cdef uintptr_t host, ptr = 0
    cdef bytearray buf
    cdef int r = 0
    chunk.ptr, chunk.nbytes = 0, 0
    while b != NULL:
        total += b.size if b.state == LIVE else 0
        b = b.seg_next
    if total and spare.nbytes >= total:
        chunk, spare.ptr, spare.nbytes = spare[0], 0, 0
    elif total:
        of_free(up, spare, c)
        if up.host_alloc(total, &ptr) == 0:
            chunk.ptr, chunk.nbytes = ptr, total
            c.pinned += total
        else:
            up.clear_error()
    if chunk.ptr:
        held.append((chunk.ptr, chunk.nbytes))
    host = chunk.ptr
    b = seg.first
    while b != NULL and r == 0:
        if b.state != LIVE:
            b = b.seg_next
            continue
        run, end = 0, b
        while end != NULL and end.state == LIVE:        # blocks tile the segment: adjacent
            run += end.size
            end = end.seg_next
        if chunk.ptr:
            r = up.copy(DEVICE_TO_PINNED, host, b.ptr, run, 0)
            copies.append((b.ptr, host, run))
            host += run
        else:
            buf = bytearray(run)
            held.append(buf)
            r = up.copy(DEVICE_TO_HOST, <uintptr_t>PyByteArray_AS_STRING(buf), b.ptr, run, 0)
            copies.append((b.ptr, <uintptr_t>PyByteArray_AS_STRING(buf), run))
        b = end
    return r if r else up.synchronize()
