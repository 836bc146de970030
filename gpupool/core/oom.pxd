# The out-of-memory ladder's last step and its error: the on_oom callbacks (run by the caller,
# with the GIL, outside the pool's lock) and the OutOfMemoryError built from the pool's numbers.
from gpupool.records.counters cimport Counters
from gpupool.core.state cimport PoolState

cdef bint oom_run_callbacks(Counters* c, int device, size_t nbytes) except -1
cdef object oom_error(int device, Counters c, size_t hard_limit, size_t nbytes)


cdef inline size_t oom_headroom(PoolState* st) noexcept nogil:
    """What the pool may still reserve under its hard limit (0 without one), for the memory
    history's out-of-memory entry: as for the error, no driver call is made."""
    cdef size_t limit = st.segments.hard_limit, reserved = st.counters.reserved
    return limit - reserved if limit > reserved else 0
