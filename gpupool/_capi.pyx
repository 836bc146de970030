# cython: language_level=3, boundscheck=False, wraparound=False
"""gpupool's C API: a versioned table of C functions, published as the capsule
``gpupool._capi._C_API`` (see include/gpupool.h).

The functions run without the GIL (they take it only to create a device's default pool on
first use and to run ``on_oom`` callbacks) and never raise: they return GPUPOOL_OK or an error
code. Memory is served by the device's default pool (``gpupool.get_pool(device)``), so C and
Python share one pool, and a C allocation made on a thread inside ``with region:`` is cached
by that region. The PyTorch entry points (``_torch.pyx``) are users of this table.
"""
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool._block cimport Block
from gpupool._counters cimport Counters
from gpupool._defaults cimport default_pool, pool_table
from gpupool._driver cimport fork_flag
from gpupool._history cimport (
    LOG_CALLBACK_RETRY, LOG_OOM, hist_on, hist_subscribe, hist_alloc, hist_oom, hist_log,
)
from gpupool._pool cimport Pool, run_oom_callbacks
from gpupool._ptrtable cimport pt_insert, pt_lookup
from gpupool._sizes cimport MAX_NBYTES
from gpupool._status cimport (
    GPUPOOL_OK, GPUPOOL_ERROR_INVALID_VALUE, GPUPOOL_ERROR_OUT_OF_MEMORY,
    GPUPOOL_ERROR_NO_DEVICE, GPUPOOL_ERROR_FORKED, GPUPOOL_ERROR_INTERNAL, GP_FORKED,
)
from gpupool._streams cimport StreamKey, BAD_STREAM_TAG, key_of, refused_stream_status

from gpupool.capi cimport gpupool_api, gpupool_stats, GPUPOOL_API_VERSION

cdef size_t STATS_FIELDS = sizeof(gpupool_stats) // sizeof(size_t)
cdef PyObject** _pools = pool_table()
cdef const int* FORKED = fork_flag()
cdef int RECORDING = 0                  # the memory history's switch (_history.pxd)
hist_subscribe(&RECORDING)


cdef int _code(int status) noexcept nogil:
    if status == 0 or status == CUDA_ERROR_OUT_OF_MEMORY or status == GP_FORKED:
        return status
    if status < 1000:
        return status                       # a CUresult from the driver
    return GPUPOOL_ERROR_INTERNAL


cdef bint _callbacks(Pool pool, size_t nbytes) noexcept with gil:
    try:
        return run_oom_callbacks(pool, nbytes)
    except Exception:
        return False


cdef void fill_stats(Counters* c, gpupool_stats* out) noexcept nogil:
    """The C API's view of a pool's counters record: gpupool_stats is the record's first
    STATS_FIELDS fields, in the record's order (tests/test_capi.py checks each against
    Pool.stats())."""
    cdef size_t i
    for i in range(STATS_FIELDS):
        (<size_t*>out)[i] = (<size_t*>c)[i]


# The table's functions look the pool up as a borrowed PyObject* (no reference counting, so
# no GIL) and call these, which take it typed; the casts below only change the pointer type.

cdef int _acquire(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef Block* b = NULL
    cdef int r
    cdef StreamKey key = key_of(pool.upstream, stream)
    if key.tag == BAD_STREAM_TAG:
        return refused_stream_status(pool.upstream, stream)     # not a stream, or destroyed
    pool.lock()
    r = pool.acquire_locked(nbytes, key, &b)
    if r == 0:
        pt_insert(&pool.capi_blocks, b.ptr, b)
        ptr[0] = <void*>b.ptr
        if hist_on(RECORDING):
            hist_alloc(pool.device, pool._segments.pool_id, b.ptr, nbytes, key.handle)
    pool.unlock()
    return r


cdef int _allocate(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef int r = _acquire(pool, nbytes, stream, ptr)
    if r == CUDA_ERROR_OUT_OF_MEMORY:
        if _callbacks(pool, nbytes):
            r = _acquire(pool, nbytes, stream, ptr)
            hist_log(LOG_CALLBACK_RETRY, pool.device, nbytes, 0, r)
        if r == CUDA_ERROR_OUT_OF_MEMORY:
            _out_of_memory(pool, nbytes, stream)
    return _code(r)


cdef void _out_of_memory(Pool pool, size_t nbytes, uintptr_t stream) noexcept nogil:
    """An allocation failed for lack of memory after the ladder: logged and, while the memory
    history records, recorded."""
    pool.lock()
    if RECORDING:
        hist_oom(pool.device, pool._segments.pool_id, nbytes, pool._oom_free_bytes(), stream)
    pool.unlock()
    hist_log(LOG_OOM, pool.device, nbytes, 0, CUDA_ERROR_OUT_OF_MEMORY)


cdef int _free(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    cdef Block* b
    cdef StreamKey key = key_of(pool.upstream, stream)
    if key.tag == BAD_STREAM_TAG:
        key.tag = 0                                 # a free never fails: keyed by handle alone
    pool.lock()
    b = pt_lookup(&pool.capi_blocks, <uintptr_t>ptr, True)
    if b != NULL:
        pool.release_locked(b, key)
    pool.unlock()
    return GPUPOOL_OK if b != NULL else GPUPOOL_ERROR_INVALID_VALUE


cdef int _record_stream(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    cdef Block* b
    cdef StreamKey key = key_of(pool.upstream, stream)
    if key.tag == BAD_STREAM_TAG:
        return refused_stream_status(pool.upstream, stream)
    pool.lock()
    b = pt_lookup(&pool.capi_blocks, <uintptr_t>ptr, False)
    pool.unlock()
    if b == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool.add_stream(b, key)
    return GPUPOOL_OK


cdef int _get_stats(Pool pool, gpupool_stats* out) noexcept nogil:
    pool.lock()
    fill_stats(&pool.counters, out)
    pool.unlock()
    return GPUPOOL_OK


ctypedef int (*allocate_fn)(PyObject*, size_t, uintptr_t, void**) noexcept nogil
ctypedef int (*free_fn)(PyObject*, void*, uintptr_t) noexcept nogil
ctypedef int (*stats_fn)(PyObject*, gpupool_stats*) noexcept nogil
cdef allocate_fn allocate_in = <allocate_fn>_allocate
cdef free_fn free_in = <free_fn>_free
cdef free_fn record_stream_in = <free_fn>_record_stream
cdef stats_fn get_stats_in = <stats_fn>_get_stats


cdef int capi_allocate(int device, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef PyObject* pool
    if ptr == NULL or nbytes == 0 or nbytes > MAX_NBYTES:
        return GPUPOOL_ERROR_INVALID_VALUE
    ptr[0] = NULL
    if FORKED[0]:
        return GPUPOOL_ERROR_FORKED
    pool = default_pool(_pools, device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return allocate_in(pool, nbytes, stream, ptr)


cdef int capi_free(int device, void* ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* pool
    if ptr == NULL:
        return GPUPOOL_OK
    if FORKED[0]:
        return GPUPOOL_ERROR_FORKED
    pool = default_pool(_pools, device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return free_in(pool, ptr, stream)


cdef int capi_record_stream(int device, void* ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* pool = default_pool(_pools, device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return record_stream_in(pool, ptr, stream)


cdef int capi_get_stats(int device, gpupool_stats* out) noexcept nogil:
    cdef PyObject* pool = default_pool(_pools, device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    if out == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    return get_stats_in(pool, out)


cdef const char* capi_error_string(int code) noexcept nogil:
    if code == GPUPOOL_OK:
        return "no error"
    if code == GPUPOOL_ERROR_INVALID_VALUE:
        return "invalid value: a zero or absurd size, or a pointer not from this API"
    if code == GPUPOOL_ERROR_OUT_OF_MEMORY:
        return "out of memory (after releasing cached blocks and running on_oom callbacks)"
    if code == GPUPOOL_ERROR_NO_DEVICE:
        return "no CUDA driver, or no such device"
    if code == GPUPOOL_ERROR_FORKED:
        return "the pool was inherited through fork() and cannot be used"
    if code == GPUPOOL_ERROR_INTERNAL:
        return "internal error (see the Python exception of the same call from Python)"
    return "CUDA driver error (a CUresult: see cuGetErrorName)"


cdef gpupool_api _api
_api.version = GPUPOOL_API_VERSION
_api.size = sizeof(gpupool_api)
_api.allocate = capi_allocate
_api.free = capi_free
_api.record_stream = capi_record_stream
_api.get_stats = capi_get_stats
_api.error_string = capi_error_string

_C_API = PyCapsule_New(<void*>&_api, b"gpupool._capi._C_API", NULL)
