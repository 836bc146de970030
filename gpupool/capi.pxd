# Cython declarations of gpupool's C API (gpupool/include/gpupool.h):
#
#     from gpupool.capi cimport gpupool_api, gpupool_import
#     cdef const gpupool_api* api = gpupool_import()
#
# Compile with include_dirs=[gpupool.get_include()] (and, for an editable install of gpupool,
# cythonize(..., include_path=[folder holding the gpupool package])).
from libc.stdint cimport uintptr_t
from gpupool.driver.status cimport (   # the status codes (gpupool_status.h, included by gpupool.h)
    GPUPOOL_OK, GPUPOOL_ERROR_INVALID_VALUE, GPUPOOL_ERROR_OUT_OF_MEMORY,
    GPUPOOL_ERROR_NO_DEVICE, GPUPOOL_ERROR_FORKED, GPUPOOL_ERROR_INTERNAL, GPUPOOL_ERROR_ASLEEP,
)

cdef extern from "gpupool.h" nogil:
    enum:
        GPUPOOL_API_VERSION

    ctypedef struct gpupool_stats:
        size_t in_use_bytes, peak_in_use_bytes, reserved_bytes, peak_reserved_bytes
        size_t cached_bytes, num_allocs, num_frees, cache_hits, cache_misses
        size_t upstream_allocs, upstream_frees, oom_retries, num_ooms
        size_t allocated_bytes, freed_bytes

    ctypedef struct gpupool_api:
        unsigned int version
        unsigned int size
        int (*allocate)(int device, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil
        int (*free)(int device, void* ptr, uintptr_t stream) noexcept nogil
        int (*record_stream)(int device, void* ptr, uintptr_t stream) noexcept nogil
        int (*get_stats)(int device, gpupool_stats* out) noexcept nogil
        const char* (*error_string)(int code) noexcept nogil
        int (*free_ptr)(int device, void* ptr) noexcept nogil
        int (*trim)(int device, size_t* released) noexcept nogil
        int (*reset_peaks)(int device) noexcept nogil
        int (*cache_info)(int device, size_t* largest, size_t* headroom) noexcept nogil
        int (*base_allocation)(int device, void* ptr, uintptr_t* base,
                               size_t* nbytes) noexcept nogil
        int (*private_new)(int device, void** pool) noexcept nogil
        int (*private_allocate)(void* pool, size_t nbytes, uintptr_t stream,
                                void** ptr) noexcept nogil
        int (*private_live)(void* pool, uintptr_t* ptrs, size_t* sizes, size_t capacity,
                            size_t* count) noexcept nogil
        int (*private_allocate_at)(void* pool, void* ptr, size_t nbytes,
                                   uintptr_t stream) noexcept nogil
        int (*private_destroy)(void* pool) noexcept nogil

cdef extern from "gpupool.h":
    const gpupool_api* gpupool_import() except NULL
