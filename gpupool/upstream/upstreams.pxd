# Upstreams: where the pool's memory comes from. A small C-level interface (allocate, free,
# events, stream waits, copies) with one implementation per source. Every method returns a
# status code (0, a CUresult, or GP_PY_ERROR) and never raises, so the pool can call it under
# its lock; error() turns a code into the Python exception.
from libc.stdint cimport uintptr_t
from libcpp.unordered_map cimport unordered_map

from gpupool.driver.status cimport GP_PY_ERROR

cdef enum CopyKind:
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3

cdef class Upstream:
    cdef readonly int device
    cdef readonly bint stream_ordered   # alloc is ordered on its stream (not usable before)
    cdef readonly bint host_accessible  # its memory is host memory (DLPack exports kDLCPU)
    cdef readonly bint expandable       # memory is pages mapped into reserved address ranges
    cdef readonly size_t granularity    # expandable: bytes of a page
    cdef readonly size_t va_bytes       # expandable: bytes of address space a range reserves
    cdef object _pending          # exception raised by a Python upstream, for error()

    cdef int alloc(self, size_t nbytes, uintptr_t stream, uintptr_t* ptr) noexcept nogil
    cdef int free(self, uintptr_t ptr) noexcept nogil
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
    cdef int stream_id(self, uintptr_t stream, unsigned long long* out) noexcept nogil
    cdef int stream_capturing(self, uintptr_t stream, bint* out) noexcept nogil
    cdef int set_release_threshold(self, size_t nbytes) noexcept nogil
    cdef int trim(self) noexcept nogil
    cdef int reserve(self, uintptr_t* va) noexcept nogil
    cdef int unreserve(self, uintptr_t va) noexcept nogil
    cdef int map(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef int unmap(self, uintptr_t va, size_t nbytes) noexcept nogil
    cdef int raise_error(self, int code, str what) except -1
    cdef void clear_error(self) noexcept nogil

cdef class DriverUpstream(Upstream):
    cdef void* ctx                # the device's primary context (CUcontext), retained
    cdef int retained

    cdef int _enter(self, void** previous) noexcept nogil
    cdef int _leave(self, void* previous, int result) noexcept nogil

cdef class AsyncUpstream(DriverUpstream):
    cdef void* mempool            # CUmemoryPool of its own, created on the device
    cdef size_t threshold         # its release threshold in bytes

cdef class VmmUpstream(DriverUpstream):
    cdef unordered_map[uintptr_t, unsigned long long] pages     # mapped page -> its handle
    cdef readonly bint shareable        # pages are made exportable (POSIX file descriptors)
    cdef int share_refused              # the CUresult that turned shareable off; 0: none

    cdef void _release_pages(self, uintptr_t va, size_t nbytes) noexcept nogil

cdef class PythonUpstream(Upstream):
    cdef int _call(self, str name, tuple args, uintptr_t* out, size_t* out2) noexcept
    cdef void clear_error(self) noexcept nogil
