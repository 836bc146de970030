# The C API's allocate and free for a given pool (the table's functions serve the device's
# default pool): the status codes of include/gpupool_status.h, never an exception. For the
# adapters that serve a pool the caller names (adapters/rmm_entry.pyx).
from libc.stdint cimport uintptr_t
from gpupool.core.pool cimport Pool

cdef int pool_allocate(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil
cdef int pool_free(Pool pool, void* ptr, uintptr_t stream) noexcept nogil
cdef const char* capi_error_string(int code) noexcept nogil
