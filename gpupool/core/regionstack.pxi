# The per-thread stack of entered regions, and uncached(): part of the region-cache layer
# (core/regioncache.pxd), included into core/pool.pyx so that the pool reads the stack on every
# allocation without a call into another module (its functions are declared in core/pool.pxd).
#
# Which cache an allocation goes through: the innermost region of the allocating pool on the
# calling thread's stack, unless an uncached() marker is above it; else the pool's region
# entered with scope="process", if any; else none (the pool's own free lists).

# The stack lives in the calling thread's gp_thread (src/gp_magazine.h, with its magazines):
# plain thread-local data, fetched once per call.
cdef extern from "gp_magazine.h" nogil:
    """
    static char gp_uncached_marker;
    """
    int GP_REGION_DEPTH_MAX
    int GP_THREAD_POOLS
    struct gp_thread_magazine:
        void* pool
        void* magazine
    struct gp_thread:
        int region_depth
        void* region_stack[64]
        gp_thread_magazine magazines[8]
    gp_thread* gp_this_thread()
    void (*gp_magazine_exit_hook)(void*) noexcept nogil
    void gp_arm_reaper()
    bint gp_thread_alive()
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
    cdef gp_thread* t = gp_this_thread()
    if t.region_depth >= GP_REGION_DEPTH_MAX:
        return False
    t.region_stack[t.region_depth] = <void*>rc
    t.region_depth += 1
    return True


cdef void region_pop(RegionCache* rc) noexcept nogil:
    """Remove the innermost entry of rc from the calling thread's stack."""
    cdef gp_thread* t = gp_this_thread()
    cdef int i = t.region_depth, j
    while i:
        i -= 1
        if t.region_stack[i] == <void*>rc:
            for j in range(i, t.region_depth - 1):
                t.region_stack[j] = t.region_stack[j + 1]
            t.region_depth -= 1
            return


cdef inline RegionCache* current_cache(void* pool, RegionCache* process_cache) noexcept nogil:
    """The cache an allocation from pool on the calling thread goes through; NULL: none."""
    return thread_cache(gp_this_thread(), pool, process_cache)


cdef inline RegionCache* thread_cache(gp_thread* t, void* pool,
                                      RegionCache* process_cache) noexcept nogil:
    """current_cache, for thread state t fetched already."""
    cdef int i = t.region_depth
    cdef RegionCache* rc
    while i:
        i -= 1
        rc = <RegionCache*>t.region_stack[i]
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
