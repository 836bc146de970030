# Offload (docs/design.md, Note [Sleep and wake]): a sleeping tag's live bytes kept in host
# memory, in one chunk its segment holds (Segment.offload), copied in runs of adjacent live
# blocks: the upstream's page-locked memory (host_alloc), each copy queued without a wait and
# the device synchronized once; where the upstream has none (or refuses it), malloc's, each
# copy waited for. After wake a page-locked chunk stays with the pool (the spare) for the next
# sleep, so a steady cycle pins nothing. Once a sleeping segment's last live block is freed its
# chunk goes back at once: nothing is left to restore (tg_free). Under the pool's lock.
from libc.stdint cimport uintptr_t
from libc.stdlib cimport malloc, free
from gpupool.records.block cimport Block, Segment, HostChunk, LIVE
from gpupool.records.counters cimport Counters
from gpupool.upstream.base cimport Upstream, DEVICE_TO_HOST, DEVICE_TO_PINNED


cdef inline void of_free(Upstream up, HostChunk* chunk, Counters* c) noexcept nogil:
    """Give chunk back (host_free, or free) and empty it; the pool holds it no more either
    way (a refused host_free leaves it with the upstream)."""
    if chunk.ptr == 0:
        return
    if chunk.pinned:
        if up.host_free(chunk.ptr) != 0:
            up.clear_error()
        c.pinned -= chunk.nbytes
    else:
        free(<void*>chunk.ptr)
    chunk.ptr, chunk.nbytes, chunk.pinned = 0, 0, False


cdef inline void of_keep(Upstream up, HostChunk* spare, Counters* c,
                         HostChunk* chunk) noexcept nogil:
    """Take back chunk (a wake's, or a failed sleep's) and empty it: a page-locked one
    becomes the spare, the larger of the two kept and the other given back; malloc's is
    freed."""
    if chunk.pinned and chunk.nbytes > spare.nbytes:
        of_free(up, spare, c)
        spare[0] = chunk[0]
        chunk.ptr, chunk.nbytes, chunk.pinned = 0, 0, False
    else:
        of_free(up, chunk, c)


cdef inline int of_copy_out(Upstream up, Segment* seg, HostChunk* spare, Counters* c,
                            HostChunk* chunk, list copies) except? -1:
    """Copy the live blocks of seg to host memory, into chunk (empty on entry): the spare
    chunk when it holds them all, else a new page-locked chunk of their size (the spare
    given back first), else (none to be had) malloc's. Each run of adjacent live blocks is
    one copy; then one synchronize. copies gets (device pointer, host address, bytes) per
    run. Returns a status code; raises MemoryError when no host memory is to be had."""
    cdef Block* b = seg.first
    cdef Block* end
    cdef size_t total = 0, run
    cdef uintptr_t host, ptr = 0
    cdef int r = 0
    while b != NULL:
        total += b.size if b.state == LIVE else 0
        b = b.seg_next
    if total and spare.nbytes >= total:
        chunk[0] = spare[0]
        spare.ptr, spare.nbytes, spare.pinned = 0, 0, False
    elif total:
        of_free(up, spare, c)
        if up.host_alloc(total, &ptr) == 0:
            chunk.ptr, chunk.nbytes, chunk.pinned = ptr, total, True
            c.pinned += total
        else:
            up.clear_error()
            chunk.ptr = <uintptr_t>malloc(total)
            if chunk.ptr == 0:
                raise MemoryError(f"sleep: no host memory for the {total} bytes to offload")
            chunk.nbytes = total
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
        r = up.copy(DEVICE_TO_PINNED if chunk.pinned else DEVICE_TO_HOST, host, b.ptr, run, 0)
        copies.append((b.ptr, host, run))
        host += run
        b = end
    return r if r else up.synchronize()
