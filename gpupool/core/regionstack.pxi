# Pushing and popping the calling thread's stack of entered regions, and uncached(): module-level
# functions of core/pool.pyx (declared in core/pool.pxd), since the stack is thread-local data
# of that module alone (core/thread.pxd).

# The stack is the calling thread's (core/thread.pxd, src/gp_region_stack.h).
cdef RegionCache* UNCACHED = uncached_mark()


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
    if t.regions.depth >= GP_REGION_DEPTH_MAX:
        return False
    t.regions.entries[t.regions.depth] = <void*>rc
    t.regions.depth += 1
    return True


cdef void region_pop(RegionCache* rc) noexcept nogil:
    """Remove the innermost entry of rc from the calling thread's stack."""
    cdef gp_thread* t = gp_this_thread()
    cdef int i = t.regions.depth, j
    while i:
        i -= 1
        if t.regions.entries[i] == <void*>rc:
            for j in range(i, t.regions.depth - 1):
                t.regions.entries[j] = t.regions.entries[j + 1]
            t.regions.depth -= 1
            return


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
