# The upstream interface: where the pool's memory comes from (the memory source) and the device
# work the pool orders around it (events, stream waits, copies), one implementation per source.
# Every method returns a status code (0, a CUresult, or GP_PY_ERROR) and never raises, so the
# pool can call it under its lock; raise_error() turns a code into the Python exception.
from libc.stdint cimport uintptr_t

from gpupool.driver.status cimport GP_PY_ERROR

cdef enum CopyKind:
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3
    DEVICE_TO_PINNED = 4        # into host_alloc's memory, not waited for (synchronize)

cdef class Upstream:
    cdef readonly int device
    cdef readonly bint stream_ordered   # alloc is ordered on its stream (not usable before)
    cdef readonly bint host_accessible  # its memory is host memory (DLPack exports kDLCPU)
    cdef readonly bint expandable       # memory is pages mapped into ranges of address space
    cdef readonly size_t granularity    # expandable: bytes of a page
    cdef readonly size_t va_bytes       # expandable: bytes of address space in a range
    cdef object pending_error     # exception raised by a Python upstream, for raise_error()

    # The memory source
    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil
    cdef int free(self, uintptr_t ptr) noexcept nogil
    cdef int set_release_threshold(self, size_t nbytes) noexcept nogil
    cdef int trim(self) noexcept nogil
    cdef int reserve(self, uintptr_t* va) noexcept nogil
    cdef int unreserve(self, uintptr_t va) noexcept nogil
    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef int map_chunk(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil

    # Device work: events, stream waits, copies, device queries
    cdef int event_create(self, uintptr_t* event) noexcept nogil
    cdef int event_destroy(self, uintptr_t event) noexcept nogil
    cdef int event_record(self, uintptr_t event, uintptr_t stream) noexcept nogil
    cdef int event_query(self, uintptr_t event) noexcept nogil
    cdef int stream_wait(self, uintptr_t stream, uintptr_t event) noexcept nogil
    cdef int synchronize(self) noexcept nogil
    cdef int copy(self, CopyKind kind, uintptr_t dst, uintptr_t src, size_t nbytes,
                  uintptr_t stream) noexcept nogil
    cdef int memset(self, uintptr_t dst, unsigned char value, size_t nbytes,
                    uintptr_t stream) noexcept nogil
    cdef int mem_info(self, size_t* free, size_t* total) noexcept nogil
    cdef int host_alloc(self, size_t nbytes, uintptr_t* ptr) noexcept nogil
    cdef int host_free(self, uintptr_t ptr) noexcept nogil
    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil
    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil

    # Status codes
    cdef void clear_error(self) noexcept nogil
    cdef int raise_error(self, int code, str what) except -1
