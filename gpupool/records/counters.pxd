# A pool's counters: one record, kept by the pool under its lock and projected once into each
# view of it (PoolStats and the PyTorch-style dict in stats.py, the C API's gpupool_stats in
# c_api/table.pyx). Bytes count blocks whole (what is reserved for them), not the bytes requested.

cdef struct Counters:
    size_t in_use               # bytes of live blocks
    size_t peak_in_use
    size_t reserved             # bytes allocated from the upstream
    size_t peak_reserved
    size_t cached               # bytes held free by the pool and its regions
    size_t num_allocs
    size_t num_frees
    size_t cache_hits           # allocations served from a free list (the pool's or a region's)
    size_t cache_misses         # allocations that needed new memory (the pool grew)
    size_t upstream_allocs
    size_t upstream_frees
    size_t oom_retries
    size_t num_ooms
    size_t allocated_bytes      # cumulative, as PyTorch's allocated_bytes.all.allocated
    size_t freed_bytes
    size_t asleep               # bytes of live blocks of sleeping tags (pages unmapped)
    size_t offloaded            # bytes of sleeping blocks copied to host memory
    size_t pinned               # page-locked host memory held for offload (core/offload.pxd)


cdef inline void add_with_peak(size_t* value, size_t* peak, size_t nbytes) noexcept nogil:
    value[0] += nbytes
    if value[0] > peak[0]:
        peak[0] = value[0]


cdef inline void count_reserved(Counters* c, size_t nbytes) noexcept nogil:
    """nbytes more allocated from the upstream (cached until handed out)."""
    add_with_peak(&c.reserved, &c.peak_reserved, nbytes)
    c.cached += nbytes
    c.upstream_allocs += 1


cdef inline void count_returned(Counters* c, size_t nbytes) noexcept nogil:
    """nbytes of cached memory given back to the upstream."""
    c.reserved -= nbytes
    c.cached -= nbytes
    c.upstream_frees += 1


cdef inline void count_acquired(Counters* c, size_t nbytes) noexcept nogil:
    """A cached block of nbytes handed out. The peak of bytes in use is the pool's to keep
    (core/pool.pyx: blocks in threads' magazines count as in use here, not there)."""
    c.cached -= nbytes
    c.in_use += nbytes
    c.allocated_bytes += nbytes
    c.num_allocs += 1


cdef inline void count_fast(Counters* c, size_t allocs, size_t allocated_bytes, size_t frees,
                            size_t freed_bytes) noexcept nogil:
    """Allocations (cache hits) and frees a fast path made off the pool's lock (a magazine's,
    a region's lane), folded in: cumulative counts only, bytes in use are the caller's."""
    c.num_allocs += allocs
    c.cache_hits += allocs
    c.allocated_bytes += allocated_bytes
    c.num_frees += frees
    c.freed_bytes += freed_bytes


cdef inline void count_freed(Counters* c, size_t nbytes) noexcept nogil:
    """A live block of nbytes freed (cached again)."""
    c.in_use -= nbytes
    c.freed_bytes += nbytes
    c.cached += nbytes
    c.num_frees += 1
