# cython: language_level=3, boundscheck=False, wraparound=False
"""gpupool's C API: a versioned table of C functions, published as the capsule
``gpupool._capi._C_API`` (see include/gpupool.h), and the entry points of PyTorch's
pluggable allocator, which are thin users of the same table.

The functions run without the GIL (they take it only to create a device's default pool on
first use, to run ``on_oom`` callbacks and to describe a failure to PyTorch) and never raise:
they return GPUPOOL_OK or an error code (PyTorch's global-allocator entry point alone throws,
see below). Memory is served by ``gpupool.get_pool(device)``, so C and Python share one pool, and a
C allocation made on a thread inside ``with region:`` is cached by that region.
"""
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from libcpp.string cimport string
from libcpp.vector cimport vector
from gpupool._block cimport Block, PtrTable, PtrSlot, StreamKey
from gpupool._pool cimport (
    Pool, pool_key, run_oom_callbacks, forked, GP_FORKED, BAD_STREAM_TAG,
)
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY


cdef extern from "Python.h" nogil:
    ctypedef enum PyGILState_STATE:
        pass
    PyGILState_STATE PyGILState_Ensure()
    void PyGILState_Release(PyGILState_STATE)

from gpupool.capi cimport (
    gpupool_api, gpupool_stats, GPUPOOL_API_VERSION, GPUPOOL_OK, GPUPOOL_ERROR_INVALID_VALUE,
    GPUPOOL_ERROR_OUT_OF_MEMORY, GPUPOOL_ERROR_NO_DEVICE, GPUPOOL_ERROR_FORKED,
    GPUPOOL_ERROR_INTERNAL,
)

from gpupool.errors import GpupoolError, OutOfMemoryError

cdef enum:
    MAX_DEVICES = 64
cdef PyObject* _pools[MAX_DEVICES]     # borrowed: gpupool keeps its default pools forever
cdef size_t MAX_NBYTES = 1 << 50


cdef PyObject* _pool_of(int device) noexcept with gil:
    import gpupool
    try:
        pool = gpupool.get_pool(device)
    except Exception:
        return NULL
    return <PyObject*>pool


cdef inline PyObject* _pool(int device) noexcept nogil:
    """The default pool of a device (borrowed), made with the GIL on first use; NULL if none."""
    if device < 0 or device >= MAX_DEVICES:
        return NULL
    if _pools[device] == NULL:
        _pools[device] = _pool_of(device)
    return _pools[device]


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


# Pointer table ----------------------------------------------------------------------------

cdef enum:
    EMPTY = 0
    DELETED = 1


cdef inline size_t _home(uintptr_t ptr, size_t mask) noexcept nogil:
    return <size_t>(((ptr >> 8) * <uintptr_t>0x9E3779B97F4A7C15) >> 32) & mask


cdef size_t _find(PtrTable* t, uintptr_t ptr) noexcept nogil:
    """Slot of ptr, or the table's size when absent."""
    cdef size_t n = t.slots.size(), i
    if n == 0:
        return 0
    i = _home(ptr, n - 1)
    while t.slots[i].first != EMPTY:
        if t.slots[i].first == ptr:
            return i
        i = (i + 1) & (n - 1)
    return n


cdef void _insert(PtrTable* t, uintptr_t ptr, Block* b) noexcept nogil:
    cdef vector[PtrSlot] old
    cdef size_t n = t.slots.size(), i
    if 2 * (t.used + 1) > n:                # keep at most half the slots used
        old.swap(t.slots)
        t.slots.assign(max(64, 2 * n), PtrSlot(EMPTY, NULL))
        t.used = 0
        for i in range(old.size()):
            if old[i].first > DELETED:
                _insert(t, old[i].first, old[i].second)
        n = t.slots.size()
    i = _home(ptr, n - 1)
    while t.slots[i].first > DELETED:
        i = (i + 1) & (n - 1)
    if t.slots[i].first == EMPTY:
        t.used += 1
    t.slots[i] = PtrSlot(ptr, b)


# The table's functions look the pool up as a borrowed PyObject* (no reference counting, so
# no GIL) and call these, which take it typed; the casts below only change the pointer type.

cdef int _acquire(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef Block* b = NULL
    cdef int r
    cdef StreamKey key = pool_key(pool, stream)
    if key.tag == BAD_STREAM_TAG:
        return pool.stream_status(stream)           # not a stream, or a destroyed one
    pool.lock()
    r = pool.acquire_locked(nbytes, key, &b)
    if r == 0:
        _insert(&pool._capi_blocks, b.ptr, b)
        ptr[0] = <void*>b.ptr
    pool.unlock()
    return r


cdef int _allocate(Pool pool, size_t nbytes, uintptr_t stream, void** ptr) noexcept nogil:
    cdef int r = _acquire(pool, nbytes, stream, ptr)
    if r == CUDA_ERROR_OUT_OF_MEMORY and _callbacks(pool, nbytes):
        r = _acquire(pool, nbytes, stream, ptr)
    return _code(r)


cdef Block* _block_of(Pool pool, void* ptr, bint remove) noexcept nogil:
    """The C API's block at ptr (the caller holds the pool's lock), taken out of the table if
    remove; NULL when the C API did not hand it out."""
    cdef size_t i = _find(&pool._capi_blocks, <uintptr_t>ptr)
    if i >= pool._capi_blocks.slots.size():
        return NULL
    if remove:
        pool._capi_blocks.slots[i].first = DELETED
    return pool._capi_blocks.slots[i].second


cdef int _free(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    cdef Block* b
    cdef StreamKey key = pool_key(pool, stream)
    if key.tag == BAD_STREAM_TAG:
        key.tag = 0                                 # a free never fails: keyed by handle alone
    pool.lock()
    b = _block_of(pool, ptr, True)
    if b != NULL:
        pool.release_locked(b, key)
    pool.unlock()
    return GPUPOOL_OK if b != NULL else GPUPOOL_ERROR_INVALID_VALUE


cdef int _record_stream(Pool pool, void* ptr, uintptr_t stream) noexcept nogil:
    cdef Block* b
    cdef StreamKey key = pool_key(pool, stream)
    if key.tag == BAD_STREAM_TAG:
        return pool.stream_status(stream)
    pool.lock()
    b = _block_of(pool, ptr, False)
    pool.unlock()
    if b == NULL:
        return GPUPOOL_ERROR_INVALID_VALUE
    pool.add_stream(b, key)
    return GPUPOOL_OK


cdef int _get_stats(Pool pool, gpupool_stats* out) noexcept nogil:
    pool.lock()
    out.in_use_bytes = pool.c.in_use
    out.peak_in_use_bytes = pool.c.peak_in_use
    out.reserved_bytes = pool.c.reserved
    out.peak_reserved_bytes = pool.c.peak_reserved
    out.cached_bytes = pool.c.cached
    out.num_allocs = pool.c.num_allocs
    out.num_frees = pool.c.num_frees
    out.cache_hits = pool.c.cache_hits
    out.cache_misses = pool.c.cache_misses
    out.upstream_allocs = pool.c.upstream_allocs
    out.upstream_frees = pool.c.upstream_frees
    out.oom_retries = pool.c.oom_retries
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
    if forked():
        return GPUPOOL_ERROR_FORKED
    pool = _pool(device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return allocate_in(pool, nbytes, stream, ptr)


cdef int capi_free(int device, void* ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* pool
    if ptr == NULL:
        return GPUPOOL_OK
    if forked():
        return GPUPOOL_ERROR_FORKED
    pool = _pool(device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return free_in(pool, ptr, stream)


cdef int capi_record_stream(int device, void* ptr, uintptr_t stream) noexcept nogil:
    cdef PyObject* pool = _pool(device)
    if pool == NULL:
        return GPUPOOL_ERROR_NO_DEVICE
    return record_stream_in(pool, ptr, stream)


cdef int capi_get_stats(int device, gpupool_stats* out) noexcept nogil:
    cdef PyObject* pool = _pool(device)
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


def _forget(int device):
    """Drop the cached default pool of a device (gpupool.set_pool replaced it)."""
    if 0 <= device < MAX_DEVICES:
        _pools[device] = NULL


_C_API = PyCapsule_New(<void*>&_api, b"gpupool._capi._C_API", NULL)


# PyTorch's pluggable allocator ----------------------------------------------------------
#
# torch.cuda.memory.CUDAPluggableAllocator looks these up by name in this extension
# (CYTHON_EXTERN_C gives them C linkage). PyTorch calls a malloc from two places, which treat
# a failure differently, hence two mallocs sharing one free:
#
# * gpupool_torch_malloc, for torch.cuda.MemPool. PyTorch's caching allocator calls it with
#   its own lock held and takes NULL as out of memory: it frees its cache, retries, calls its
#   out-of-memory observers and raises torch.OutOfMemoryError. So this malloc returns NULL and
#   records the failure for the calling thread without taking the GIL (another thread may
#   hold the GIL while waiting for that lock); gpupool.torch's observer turns the record into
#   gpupool's message (_take_torch_failure).
# * gpupool_torch_malloc_raising, for PyTorch's global allocator (change_current_allocator).
#   There PyTorch does not check the pointer (a NULL becomes a tensor at address 0), so a
#   failure is thrown as a C++ exception that PyTorch's Python bindings translate into a
#   Python exception: a torch::PyTorchError, whose virtual python_type() and what() name the
#   type and message. No PyTorch lock is held there, so the message is built at once.

cdef extern from *:
    """
    #include <exception>
    #include <string>
    namespace torch {
    // As declared in torch/csrc/Exceptions.h. PyTorch's bindings catch it by reference (the
    // type matches by name across libraries) and raise python_type() with what(); both are
    // virtual, so only the order of the virtual functions must agree with PyTorch's.
    struct PyTorchError : public std::exception {
      PyTorchError() = default;
      explicit PyTorchError(std::string msg_) : msg(std::move(msg_)) {}
      virtual PyObject* python_type() = 0;
      const char* what() const noexcept override { return msg.c_str(); }
      std::string msg;
    };
    }
    struct GpupoolTorchError : public torch::PyTorchError {
      GpupoolTorchError(std::string msg_, PyObject* type_)
          : PyTorchError(std::move(msg_)), type(type_) {}
      PyObject* python_type() override { return type; }
      PyObject* type;    // borrowed: gpupool keeps the exception types it names alive
    };
    [[noreturn]] static void gp_torch_throw(const std::string& msg, PyObject* type) {
      throw GpupoolTorchError(msg, type);
    }
    // Calls a malloc as PyTorch's bindings do, catching what they catch into type and msg.
    static void* gp_torch_call(void* (*f)(size_t, int, void*), size_t size, int device,
                               void* stream, PyObject** type, std::string* msg) {
      try {
        return f(size, device, stream);
      } catch (torch::PyTorchError& e) {
        *type = e.python_type();
        *msg = e.what();
        return NULL;
      }
    }
    struct GpTorchFailure { int status; int device; size_t size; };
    // The calling thread's failed gpupool_torch_malloc (status 0: none since its last success).
    static thread_local GpTorchFailure gp_torch_failure = {0, 0, 0};
    """
    ctypedef void* (*torch_malloc_fn)(size_t, int, void*) noexcept nogil
    ctypedef struct GpTorchFailure:
        int status
        int device
        size_t size
    GpTorchFailure gp_torch_failure
    void gp_torch_throw(const string& msg, PyObject* type) nogil
    void* gp_torch_call(torch_malloc_fn f, size_t size, int device, void* stream,
                        PyObject** type, string* msg)

_torch_oom_type = OutOfMemoryError      # gpupool.torch sets a torch.OutOfMemoryError subclass
_torch_last_error = None


cdef PyObject* _torch_failure(int status, int device, size_t size,
                              string* msg) noexcept with gil:
    """Describe a failed PyTorch allocation in msg (and count it if out of memory); returns the
    Python exception type to raise (borrowed: a module-level type)."""
    global _torch_last_error
    cdef PyObject* found = _pool(device)
    cdef Pool pool
    kind = GpupoolError
    try:
        if status == CUDA_ERROR_OUT_OF_MEMORY and found != NULL:
            pool = <Pool>found
            pool.lock()
            pool.c.num_ooms += 1
            pool.unlock()
            text = pool._oom_message(size)
            kind = _torch_oom_type
        else:
            text = (f"gpupool: allocating {size} B for PyTorch on device {device} failed: "
                    f"{capi_error_string(status).decode()} (status {status})")
    except BaseException as e:              # never let the message hide the failure itself
        text = f"gpupool: allocating {size} B for PyTorch on device {device} failed ({e!r})"
    _torch_last_error = text
    msg[0] = text.encode()
    return <PyObject*>kind


cdef public void* gpupool_torch_malloc(size_t size, int device, void* stream) noexcept nogil:
    cdef void* ptr = NULL
    cdef int status
    if size == 0:
        return NULL
    status = capi_allocate(device, size, <uintptr_t>stream, &ptr)
    gp_torch_failure.status = status
    if status != GPUPOOL_OK:
        gp_torch_failure.device = device
        gp_torch_failure.size = size
    return ptr


cdef void _throw_torch_failure(int status, int device, size_t size) noexcept nogil:
    """Throw a failed allocation to PyTorch (never returns; the GIL is released by then)."""
    cdef string msg
    cdef PyObject* kind = _torch_failure(status, device, size, &msg)
    gp_torch_throw(msg, kind)


cdef public void* gpupool_torch_malloc_raising(size_t size, int device,
                                               void* stream) noexcept nogil:
    cdef void* ptr = NULL
    cdef int status
    if size == 0:
        return NULL
    status = capi_allocate(device, size, <uintptr_t>stream, &ptr)
    if status != GPUPOOL_OK:
        _throw_torch_failure(status, device, size)
    return ptr


cdef public void gpupool_torch_free(void* ptr, size_t size, int device,
                                    void* stream) noexcept nogil:
    capi_free(device, ptr, <uintptr_t>stream)


def _set_torch_oom_type(kind):
    """Make ``kind`` (a ``gpupool.OutOfMemoryError`` subclass) the type PyTorch raises for an
    out-of-memory failure of ``gpupool_torch_malloc_raising``."""
    global _torch_oom_type
    if not (isinstance(kind, type) and issubclass(kind, OutOfMemoryError)):
        raise TypeError("the type must subclass gpupool.OutOfMemoryError")
    _torch_oom_type = kind


def _take_torch_failure(int device=-1):
    """``(exception type, message)`` of the calling thread's failed ``gpupool_torch_malloc``
    since its last success (on ``device``, if >= 0), or None; forgets it."""
    cdef string msg
    cdef GpTorchFailure failure = gp_torch_failure
    gp_torch_failure.status = GPUPOOL_OK
    if failure.status == GPUPOOL_OK or (device >= 0 and failure.device != device):
        return None
    kind = <object>_torch_failure(failure.status, failure.device, failure.size, &msg)
    return kind, msg.decode()


def _torch_last_failure():
    """Message of the last failed allocation through the PyTorch entry points, or None."""
    return _torch_last_error


def _torch_malloc_checked(size_t size, int device=0, uintptr_t stream=0):
    """Call ``gpupool_torch_malloc_raising`` as PyTorch's Python bindings do: a failure thrown
    as a C++ exception is raised as the Python type it names. Returns the pointer (for tests;
    free it with ``_torch_free``)."""
    cdef string msg
    cdef PyObject* kind = NULL
    cdef void* ptr = gp_torch_call(gpupool_torch_malloc_raising, size, device, <void*>stream,
                                   &kind, &msg)
    if kind != NULL:
        raise (<object>kind)(msg.decode())
    return <uintptr_t>ptr


def _torch_malloc(size_t size, int device=0, uintptr_t stream=0):
    """Call ``gpupool_torch_malloc`` (NULL on failure) and return the pointer (for tests)."""
    return <uintptr_t>gpupool_torch_malloc(size, device, <void*>stream)


def _torch_free(uintptr_t ptr, size_t size=0, int device=0, uintptr_t stream=0):
    """Call ``gpupool_torch_free`` (for tests)."""
    gpupool_torch_free(<void*>ptr, size, device, <void*>stream)
