# A device's primary context and the driver's device work on it (events, stream waits, copies,
# device queries): the base of the driver upstreams, which add a memory source.
from gpupool.upstream.base cimport Upstream

cdef class DriverDevice(Upstream):
    cdef void* ctx                # the device's primary context (CUcontext), retained
    cdef int retained

    # Make the context current; the caller's goes to previous, for restore_current.
    cdef int make_current(self, void** previous) noexcept nogil
    # Make previous current again; returns result, or the failure of doing so.
    cdef int restore_current(self, void* previous, int result) noexcept nogil
