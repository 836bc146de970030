# The calling thread's state (src/gp_thread.h): its stack of entered regions, its current tag
# (gpupool.tag) and its magazines,
# fetched once per call. Its thread-local variables are static in the header: only
# core/pool.pyx's module may call these functions (and the .pxd files that only it cimports:
# core/fastpath.pxd, core/acquire.pxd), or a thread would have one state per module.
#
# Which cache an allocation goes through: the innermost region of the allocating pool on the
# calling thread's stack, unless an uncached() marker is above it; else the pool's region
# entered with scope="process", if any; else none (the pool's own free lists).
from gpupool.core.regioncache cimport RegionCache

cdef extern from "gp_thread.h" nogil:
    """
    static char gp_uncached_marker;
    """
    int GP_REGION_DEPTH_MAX
    int GP_THREAD_POOLS
    struct gp_thread_magazine:
        void* pool
        void* magazine
    struct gp_region_stack:
        int depth
        void* entries[64]
    struct gp_thread:
        gp_region_stack regions
        int tag                 # the current gpupool.tag's id; 0: none
        gp_thread_magazine magazines[8]
    gp_thread* gp_this_thread()
    void (*gp_magazine_exit_hook)(void*) noexcept nogil
    void gp_arm_reaper()
    bint gp_thread_alive()
    char gp_uncached_marker


cdef inline RegionCache* uncached_mark() noexcept nogil:
    """The marker uncached() pushes (and a region skipping its first entry): regions below it
    on the thread's stack do not apply. Any unique address serves."""
    return <RegionCache*>&gp_uncached_marker


cdef inline RegionCache* thread_cache(gp_thread* t, void* pool,
                                      RegionCache* process_cache) noexcept nogil:
    """The cache an allocation from pool on the thread of state t goes through; NULL:
    none."""
    cdef int i = t.regions.depth
    cdef RegionCache* rc
    while i:
        i -= 1
        rc = <RegionCache*>t.regions.entries[i]
        if rc == uncached_mark():
            return NULL
        if rc.pool == pool:
            return rc
    return process_cache


cdef inline RegionCache* current_cache(void* pool, RegionCache* process_cache) noexcept nogil:
    """thread_cache for the calling thread."""
    return thread_cache(gp_this_thread(), pool, process_cache)


cdef inline bint is_current_cache(RegionCache* rc, void* pool,
                                  RegionCache* process_cache) noexcept nogil:
    """Whether rc, a region of pool, is current_cache(pool, process_cache): at one compare
    when it is the innermost entry of the calling thread's stack (a block freed in the
    region it was allocated in), else by the walk."""
    cdef gp_thread* t = gp_this_thread()
    cdef int i = t.regions.depth
    if i and t.regions.entries[i - 1] == <void*>rc:
        return True                     # (rc is no uncached() marker, and pool's)
    return thread_cache(t, pool, process_cache) == rc
