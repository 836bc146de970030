# The per-thread stack of entered regions, and uncached(): part of the region-cache layer
# (_regioncache.pxd), included into _pool.pyx so that the pool reads the stack on every
# allocation without a call into another module (its functions are declared in _pool.pxd).
#
# Which cache an allocation goes through: the innermost region of the allocating pool on the
# calling thread's stack, unless an uncached() marker is above it; else the pool's region
# entered with scope="process", if any; else none (the pool's own free lists).

# Plain thread-local data, so reading it costs no TLS initialization check.
cdef extern from *:
    """
    #define GP_REGION_DEPTH_MAX 64
    static thread_local void* gp_region_stack[GP_REGION_DEPTH_MAX];
    static thread_local int gp_region_depth = 0;
    static char gp_uncached_marker;
    """
    int GP_REGION_DEPTH_MAX
    void* gp_region_stack[]
    int gp_region_depth
    char gp_uncached_marker

# Pushed by uncached() (and by a region skipping its first entry): regions below it on the
# thread's stack do not apply. Any unique address serves as the marker.
cdef RegionCache* UNCACHED = <RegionCache*>&gp_uncached_marker


cdef RegionCache* uncached_marker() noexcept nogil:
    return UNCACHED


cdef int region_push(RegionCache* rc) except -1:
    """Make rc the calling thread's innermost region (or marker)."""
    if not region_try_push(rc):
        raise GpupoolError(f"regions nested more than {GP_REGION_DEPTH_MAX} deep on one "
                           f"thread (uncached() counts as one)")
    return 0


cdef bint region_try_push(RegionCache* rc) noexcept nogil:
    """region_push without the GIL (for the C API); False, with nothing pushed, when the
    stack is full."""
    global gp_region_depth
    if gp_region_depth >= GP_REGION_DEPTH_MAX:
        return False
    gp_region_stack[gp_region_depth] = <void*>rc
    gp_region_depth += 1
    return True


cdef void region_pop(RegionCache* rc) noexcept nogil:
    """Remove the innermost entry of rc from the calling thread's stack."""
    global gp_region_depth
    cdef int i = gp_region_depth, j
    while i:
        i -= 1
        if gp_region_stack[i] == <void*>rc:
            for j in range(i, gp_region_depth - 1):
                gp_region_stack[j] = gp_region_stack[j + 1]
            gp_region_depth -= 1
            return


cdef inline RegionCache* current_cache(void* pool, RegionCache* process_cache) noexcept nogil:
    """The cache an allocation from pool on the calling thread goes through; NULL: none."""
    cdef int i = gp_region_depth
    cdef RegionCache* rc
    while i:
        i -= 1
        rc = <RegionCache*>gp_region_stack[i]
        if rc == UNCACHED:
            return NULL
        if rc.pool == pool:
            return rc
    return process_cache


class uncached:
    """Context manager: allocations inside come from the pool, not from any region.

    For buffers meant to outlive the step of an enclosing region (a logged loss, a lazily
    created workspace); covers the calling thread.
    """

    def __enter__(self):
        region_push(UNCACHED)
        return self

    def __exit__(self, *exc):
        region_pop(UNCACHED)
        return False
