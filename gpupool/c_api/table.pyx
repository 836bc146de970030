# cython: language_level=3, boundscheck=False, wraparound=False
"""gpupool's C API: a versioned table of C functions, published as the capsule
``gpupool._capi._C_API`` (see include/gpupool.h).

The functions run without the GIL (they take it only to create a device's default pool on first
use, to run ``on_oom`` callbacks and to plan a planned region's record step) and never raise:
they return GPUPOOL_OK or an error code. Memory is served by the device's default pool
(``gpupool.get_pool(device)``), so C and Python share one pool, and a C allocation made on a
thread inside ``with region:`` is cached by that region, planned as a Python one. Version 2
added frees by pointer alone, trims, peak resets, the largest free block, the segment of a
pointer, and private pools (``region/privatepool.pxd``: memory held for a CUDA graph). The
PyTorch entry points (``adapters/torch_entry.pyx``) and gpupool's C++ allocator for PyTorch
(``src/torch_allocator.cc``) are users of this table.
"""
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.records.block cimport Block
from gpupool.records.counters cimport Counters
from gpupool.core.defaults cimport MAX_DEVICES, default_pool, pool_table
from gpupool.driver.calls cimport fork_flag
from gpupool.history.ring cimport (
    LOG_CALLBACK_RETRY, LOG_OOM, hist_log,
)
from gpupool.core.pool cimport Pool, run_oom_callbacks, region_try_push, region_pop
from gpupool.region.privatepool cimport PrivatePool
from gpupool.core.regioncache cimport RegionCache, rc_slow_path
from gpupool.core.plantable cimport PW_HAND_BACK, PW_ONLINE
from gpupool.core.segments cimport BLOCK_ALIGN
from gpupool.records.sizes cimport MAX_NBYTES
from gpupool.driver.status cimport (
    GPUPOOL_OK, GPUPOOL_ERROR_INVALID_VALUE, GPUPOOL_ERROR_OUT_OF_MEMORY,
    GPUPOOL_ERROR_NO_DEVICE, GPUPOOL_ERROR_FORKED, GPUPOOL_ERROR_INTERNAL, GPUPOOL_ERROR_ASLEEP,
    GP_ASLEEP, GP_FORKED, GP_RECORDED,
)
from gpupool.records.streams cimport (
    StreamKey, BAD_STREAM_TAG, BY_HANDLE, OWN_HANDLE_TAG, STREAM_PER_THREAD, key_status,
    resolve_free, stream_key,
)

from gpupool.capi cimport gpupool_api, gpupool_stats, GPUPOOL_API_VERSION

import logging

_logger = logging.getLogger("gpupool")

cdef size_t STATS_FIELDS = sizeof(gpupool_stats) // sizeof(size_t)
cdef PyObject** _pools = pool_table()
cdef const int* FORKED = fork_flag()


cdef int _code(int status) noexcept nogil:
    if (status == 0 or status == CUDA_ERROR_OUT_OF_MEMORY or status == GP_FORKED
            or status == GP_ASLEEP):
        return status                       # public codes of the same value
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

cdef int _allocate(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    """The C API's allocate: a block from the calling thread's magazine (no pool lock), else
    through the pool's shared path, listed as handed; out of memory, the on_oom callbacks
    and one retry. A handle the driver refuses (not a stream, or destroyed) gets its status."""
    cdef Block* b
    cdef StreamKey key
    cdef int r = _stream_key(pool, stream, &key)
    if r != 0:
        return r
    b = pool.mag_take(nbytes, key, True)
    if b == NULL:
        return _allocate_shared(pool, nbytes, stream, key, ptr)
    ptr[0] = <void*>b.ptr
    return GPUPOOL_OK


cdef inline int _stream_key(Pool pool, uintptr_t stream, StreamKey* key) noexcept nogil:
    """The key of a stream handle for an allocation: GPUPOOL_OK, or the status of a handle
    the driver refuses (not a stream, or destroyed)."""
    if stream <= STREAM_PER_THREAD:             # the default streams: no driver call
        key[0] = stream_key(stream, BY_HANDLE)
        return GPUPOOL_OK
    return _code(key_status(pool.upstream, stream, key))


cdef int _allocate_shared(Pool pool, size_t nbytes, uintptr_t stream, StreamKey key,
                          void** ptr) noexcept nogil:
    """_allocate's way when the thread's magazine has no block: the pool's shared path, listed
    as handed. Other statuses than GPUPOOL_OK go to _allocate_again, which looks the key up
    again (so that _allocate, into which this is inlined, keeps no copy of it across the
    magazine's path)."""
    cdef Block* b = NULL
    cdef int r = pool.acquire_handed(nbytes, key, &b, PW_HAND_BACK)
    if r == 0:
        ptr[0] = <void*>b.ptr
        return GPUPOOL_OK
    return _allocate_again(pool, nbytes, stream, r, ptr)


cdef int _allocate_again(Pool pool, size_t nbytes, uintptr_t stream, int r,
                         void** ptr) noexcept nogil:
    """A request of the shared path that returned status r: request 0 of a planned region's
    record step, handed back undone (GP_RECORDED: _allocate_record), or a failure
    (_allocate_failed: the out-of-memory way)."""
    cdef StreamKey key
    cdef int found = _stream_key(pool, stream, &key)
    if found != GPUPOOL_OK:
        return found
    if r == GP_RECORDED:
        return _allocate_record(pool, nbytes, stream, key, ptr)
    return _allocate_failed(pool, nbytes, stream, key, r, ptr)


cdef int _allocate_failed(Pool pool, size_t nbytes, uintptr_t stream, StreamKey key, int r,
                          void** ptr) noexcept nogil:
    """A request of the shared path that failed with status r: out of memory, the on_oom
    callbacks, then one retry (the magazine, then the shared path, online: PW_ONLINE, as the
    first try's plan answered; Note [Planned out-of-memory retry]); a failure for lack of
    memory is logged. Sets ptr; returns the status."""
    cdef Block* b = NULL
    if r == CUDA_ERROR_OUT_OF_MEMORY and _callbacks(pool, nbytes):
        b = pool.mag_take(nbytes, key, True)
        r = 0 if b != NULL else pool.acquire_handed(nbytes, key, &b, PW_ONLINE)
        hist_log(LOG_CALLBACK_RETRY, pool.device, nbytes, 0, r)
    if r == 0:
        ptr[0] = <void*>b.ptr
    elif r == CUDA_ERROR_OUT_OF_MEMORY:
        _out_of_memory(pool, nbytes, stream)
    return _code(r)


cdef int _allocate_record(Pool pool, size_t nbytes, uintptr_t stream, StreamKey key,
                          void** ptr) noexcept nogil:
    """Request 0 of a planned region's record step (core/planned.pxd), handed back undone:
    made again, online, then the region's slow path plans the step with the GIL, as
    Pool.allocate does after its allocation (a request of another thread of the region
    meanwhile leaves the entry online; so does one served only after the on_oom callbacks,
    which runs no slow path). An exception it raises is logged; the block is freed and the
    status is GPUPOOL_ERROR_INTERNAL."""
    cdef Block* b = NULL
    cdef int r = pool.acquire_handed(nbytes, key, &b, PW_ONLINE)
    if r != 0:
        return _allocate_failed(pool, nbytes, stream, key, r, ptr)
    if not _slow_path(b, nbytes):
        _free_as(pool, b.ptr, StreamKey(0, BAD_STREAM_TAG))
        return GPUPOOL_ERROR_INTERNAL
    ptr[0] = <void*>b.ptr
    return GPUPOOL_OK


cdef bint _slow_path(Block* b, size_t nbytes) noexcept with gil:
    """Run the allocation slow path of b's region (core/regioncache.pxd, rc_slow_path);
    False if it raised: the exception is logged with its traceback to the "gpupool" logger,
    as an on_oom callback's."""
    try:
        rc_slow_path(b)
    except BaseException:
        _logger.exception(
            "gpupool: a planned region's slow path raised after a C API allocation of %d B "
            "(request 0 of a record step); the allocation fails with GPUPOOL_ERROR_INTERNAL",
            nbytes)
        return False
    return True


cdef void _out_of_memory(Pool pool, size_t nbytes, uintptr_t stream) noexcept nogil:
    """An allocation failed for lack of memory after the ladder: logged and, while the memory
    history records, recorded."""
    pool.note_oom(nbytes, stream)
    hist_log(LOG_OOM, pool.device, nbytes, 0, CUDA_ERROR_OUT_OF_MEMORY)


cdef int _free(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    # A created stream's key is looked up only when it is not the block's own (resolve_free).
    return _free_as(pool, <uintptr_t>ptr, stream_key(stream, OWN_HANDLE_TAG))


cdef int _free_as(Pool pool, uintptr_t ptr, StreamKey key) noexcept nogil:
    """Free the C API block at ptr as last used on key's stream (key.tag BAD_STREAM_TAG: on
    its block's own stream; OWN_HANDLE_TAG: resolved against the block, resolve_free):
    through the thread's magazine when it handed the block out, else found under the pool's
    lock (in its table, or another thread's magazine)."""
    cdef Block* b
    cdef bint done
    if pool.mag_free_handed(ptr, key, &done):
        return GPUPOOL_OK                           # its thread's magazine handed it out
    b = pool.take_handed(ptr)     # (inside the pool's upstream call: free_block defers)
    if b == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool.free_block(b, resolve_free(pool.upstream, key, b.stream))
    return GPUPOOL_OK


cdef int _record_stream(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    cdef Block* b
    cdef StreamKey key
    cdef int r = key_status(pool.upstream, stream, &key)
    if r != 0:
        return r
    b = pool.find_handed(<uintptr_t>ptr)
    if b == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool.add_stream(b, key, NULL)
    return GPUPOOL_OK


cdef int _get_stats(Pool pool, gpupool_stats* out) noexcept nogil:
    cdef Counters c = pool.read_counters()
    fill_stats(&c, out)
    return GPUPOOL_OK


ctypedef int (*allocate_fn)(PyObject*, size_t, uintptr_t, void**) noexcept nogil
ctypedef int (*free_fn)(PyObject*, void*, uintptr_t) noexcept nogil
ctypedef int (*stats_fn)(PyObject*, gpupool_stats*) noexcept nogil
cdef allocate_fn allocate_in = <allocate_fn>_allocate
cdef free_fn free_in = <free_fn>_free
cdef free_fn record_stream_in = <free_fn>_record_stream
cdef stats_fn get_stats_in = <stats_fn>_get_stats


cdef int _refused(size_t nbytes, void** ptr) noexcept nogil:
    """The status of an allocation refused before any pool is looked up (GPUPOOL_OK: none);
    clears ptr."""
    if ptr == NULL or nbytes == 0 or nbytes > MAX_NBYTES:
        return GPUPOOL_ERROR_INVALID_VALUE
    ptr[0] = NULL
    return GPUPOOL_ERROR_FORKED if FORKED[0] else GPUPOOL_OK


cdef int capi_allocate(int device, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef PyObject* pool
    cdef int r = _refused(nbytes, ptr)
    if r != GPUPOOL_OK:
        return r
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


cdef int pool_allocate(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    """The C API's allocate from the given pool rather than the device's default one."""
    cdef int r = _refused(nbytes, ptr)
    return r if r != GPUPOOL_OK else _allocate(pool, nbytes, stream, ptr)


cdef int pool_free(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    """The C API's free to the given pool rather than the device's default one."""
    if ptr == NULL:
        return GPUPOOL_OK
    return GPUPOOL_ERROR_FORKED if FORKED[0] else _free(pool, ptr, stream)


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
    if code == GPUPOOL_ERROR_ASLEEP:
        return ("the memory of the calling thread's tag (gpupool.tag) sleeps (Pool.sleep): wake "
                "it (Pool.wake) before allocating with that tag")
    return "CUDA driver error (a CUresult: see cuGetErrorName)"


# Version 2 -----------------------------------------------------------------------------
# The same pattern: the table's function finds the pool (borrowed), a typed function does
# the work under its lock. Private pools: region/privatepool.pxd.

cdef int _free_found(Pool pool, void* ptr) noexcept nogil:
    """Free ptr, as last used on its block's stream, if pool's C API handed it out."""
    return _free_as(pool, <uintptr_t>ptr, StreamKey(0, BAD_STREAM_TAG))


cdef int _trim(Pool pool, size_t* released) noexcept nogil:
    return _code(pool.trim_all(released))


cdef int _reset_peaks(Pool pool) noexcept nogil:
    pool.reset_peaks()
    return GPUPOOL_OK


cdef int _cache_info(Pool pool, size_t* largest, size_t* headroom) noexcept nogil:
    pool.cache_info(largest, headroom)
    return GPUPOOL_OK


cdef int _base_allocation(Pool pool, void* ptr, uintptr_t* base, size_t* nbytes) noexcept nogil:
    if pool.handed_segment(<uintptr_t>ptr, base, nbytes):
        return GPUPOOL_OK
    return GPUPOOL_ERROR_INVALID_VALUE


cdef int _private_live(Pool pool, RegionCache* rc, uintptr_t* ptrs, size_t* sizes,
                       size_t capacity, size_t* count) noexcept nogil:
    count[0] = pool.private_live(rc, ptrs, sizes, capacity)
    return GPUPOOL_OK


cdef int _private_allocate_at(Pool pool, RegionCache* rc, void* ptr, size_t nbytes,
                              uintptr_t stream) noexcept nogil:
    cdef StreamKey key
    cdef int r = key_status(pool.upstream, stream, &key)
    if r != 0:
        return r
    if pool.private_allocate_at(rc, <uintptr_t>ptr, nbytes, key):
        return GPUPOOL_OK
    return GPUPOOL_ERROR_INVALID_VALUE


cdef int _private_end(Pool pool, RegionCache* rc) noexcept nogil:
    pool.private_end(rc)
    return GPUPOOL_OK


ctypedef int (*found_fn)(PyObject*, void*) noexcept nogil
ctypedef int (*trim_fn)(PyObject*, size_t*) noexcept nogil
ctypedef int (*pool_fn)(PyObject*) noexcept nogil
ctypedef int (*info_fn)(PyObject*, size_t*, size_t*) noexcept nogil
ctypedef int (*base_fn)(PyObject*, void*, uintptr_t*, size_t*) noexcept nogil
ctypedef int (*live_fn)(PyObject*, RegionCache*, uintptr_t*, size_t*, size_t,
                        size_t*) noexcept nogil
ctypedef int (*at_fn)(PyObject*, RegionCache*, void*, size_t, uintptr_t) noexcept nogil
ctypedef int (*end_fn)(PyObject*, RegionCache*) noexcept nogil
cdef found_fn free_found_in = <found_fn>_free_found
cdef trim_fn trim_in = <trim_fn>_trim
cdef pool_fn reset_peaks_in = <pool_fn>_reset_peaks
cdef info_fn cache_info_in = <info_fn>_cache_info
cdef base_fn base_allocation_in = <base_fn>_base_allocation
cdef live_fn private_live_in = <live_fn>_private_live
cdef at_fn private_allocate_at_in = <at_fn>_private_allocate_at
cdef end_fn private_end_in = <end_fn>_private_end


cdef PyObject* _ready_pool(int device, int* status) noexcept nogil:
    """The device's default pool for a version-2 call, or NULL with the status to return."""
    cdef PyObject* pool
    if FORKED[0]:
        status[0] = GPUPOOL_ERROR_FORKED
        return NULL
    pool = default_pool(_pools, device)
    status[0] = GPUPOOL_OK if pool != NULL else GPUPOOL_ERROR_NO_DEVICE
    return pool


cdef int capi_free_ptr(int device, void* ptr) noexcept nogil:
    cdef PyObject* pool
    cdef int d, status
    if ptr == NULL:
        return GPUPOOL_OK
    pool = _ready_pool(device, &status)
    if status == GPUPOOL_ERROR_FORKED:
        return status
    if pool != NULL and free_found_in(pool, ptr) == GPUPOOL_OK:
        return GPUPOOL_OK
    for d in range(MAX_DEVICES):        # another device's (only pools made already)
        if d != device and _pools[d] != NULL and free_found_in(_pools[d], ptr) == GPUPOOL_OK:
            return GPUPOOL_OK
    return GPUPOOL_ERROR_INVALID_VALUE


cdef int capi_trim(int device, size_t* released) noexcept nogil:
    cdef int status
    cdef size_t ignored
    cdef PyObject* pool = _ready_pool(device, &status)
    if pool == NULL:
        return status
    return trim_in(pool, released if released != NULL else &ignored)


cdef int capi_reset_peaks(int device) noexcept nogil:
    cdef int status
    cdef PyObject* pool = _ready_pool(device, &status)
    return reset_peaks_in(pool) if pool != NULL else status


cdef int capi_cache_info(int device, size_t* largest, size_t* headroom) noexcept nogil:
    cdef int status
    cdef PyObject* pool
    if largest == NULL or headroom == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool = _ready_pool(device, &status)
    return cache_info_in(pool, largest, headroom) if pool != NULL else status


cdef int capi_base_allocation(int device, void* ptr, uintptr_t* base,
                              size_t* nbytes) noexcept nogil:
    cdef int status
    cdef PyObject* pool
    if base == NULL or nbytes == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool = _ready_pool(device, &status)
    return base_allocation_in(pool, ptr, base, nbytes) if pool != NULL else status


cdef int _private_new(PyObject* pool, void** out) noexcept with gil:
    cdef PrivatePool* pp = <PrivatePool*>calloc(1, sizeof(PrivatePool))
    if pp == NULL:
        return GPUPOOL_ERROR_INTERNAL
    pp.rc = new RegionCache()
    pp.rc.pool = <void*>pool
    pp.rc.entered = 1                   # held entered for its whole life: never lent
    pp.rc.held = True
    pp.rc.entries = 1
    Py_INCREF(<object>pool)
    pp.pool = pool
    out[0] = <void*>pp
    return GPUPOOL_OK


cdef void _private_free(PrivatePool* pp) noexcept with gil:
    Py_DECREF(<object>pp.pool)
    del pp.rc
    free(pp)


cdef int capi_private_new(int device, void** out) noexcept nogil:
    cdef int status
    cdef PyObject* pool
    if out == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    out[0] = NULL
    pool = _ready_pool(device, &status)
    return _private_new(pool, out) if pool != NULL else status


cdef int capi_private_allocate(void* handle, size_t nbytes, uintptr_t stream,
                               void** ptr) noexcept nogil:
    cdef PrivatePool* pp = <PrivatePool*>handle
    cdef int r = _refused(nbytes, ptr) if pp != NULL else GPUPOOL_ERROR_INVALID_VALUE
    if r != GPUPOOL_OK:
        return r
    # The private pool is the calling thread's innermost region for this one request.
    if not region_try_push(pp.rc):
        return GPUPOOL_ERROR_INTERNAL
    r = allocate_in(pp.pool, nbytes, stream, ptr)
    region_pop(pp.rc)
    return r


cdef int capi_private_live(void* handle, uintptr_t* ptrs, size_t* sizes, size_t capacity,
                           size_t* count) noexcept nogil:
    cdef PrivatePool* pp = <PrivatePool*>handle
    if pp == NULL or count == NULL or (capacity and (ptrs == NULL or sizes == NULL)):
        return GPUPOOL_ERROR_INVALID_VALUE
    if FORKED[0]:
        return GPUPOOL_ERROR_FORKED
    return private_live_in(pp.pool, pp.rc, ptrs, sizes, capacity, count)


cdef int capi_private_allocate_at(void* handle, void* ptr, size_t nbytes,
                                  uintptr_t stream) noexcept nogil:
    cdef PrivatePool* pp = <PrivatePool*>handle
    if pp == NULL or nbytes == 0 or nbytes % BLOCK_ALIGN:
        return GPUPOOL_ERROR_INVALID_VALUE
    if FORKED[0]:
        return GPUPOOL_ERROR_FORKED
    return private_allocate_at_in(pp.pool, pp.rc, ptr, nbytes, stream)


cdef int capi_private_destroy(void* handle) noexcept nogil:
    cdef PrivatePool* pp = <PrivatePool*>handle
    if pp == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    if FORKED[0]:
        return GPUPOOL_ERROR_FORKED     # the parent's memory: left alone
    private_end_in(pp.pool, pp.rc)
    _private_free(pp)
    return GPUPOOL_OK


cdef gpupool_api _api
_api.version = GPUPOOL_API_VERSION
_api.size = sizeof(gpupool_api)
_api.allocate = capi_allocate
_api.free = capi_free
_api.record_stream = capi_record_stream
_api.get_stats = capi_get_stats
_api.error_string = capi_error_string
_api.free_ptr = capi_free_ptr
_api.trim = capi_trim
_api.reset_peaks = capi_reset_peaks
_api.cache_info = capi_cache_info
_api.base_allocation = capi_base_allocation
_api.private_new = capi_private_new
_api.private_allocate = capi_private_allocate
_api.private_live = capi_private_live
_api.private_allocate_at = capi_private_allocate_at
_api.private_destroy = capi_private_destroy

_C_API = PyCapsule_New(<void*>&_api, b"gpupool._capi._C_API", NULL)
