# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled part of ``gpupool.torch``: the C entry points of PyTorch's pluggable allocator
(``torch.cuda.memory.CUDAPluggableAllocator`` looks them up by name in this extension; the
macro CYTHON_EXTERN_C gives them C linkage), how a failure reaches PyTorch, and the message
of a failure for gpupool's C++ allocator (``src/torch_allocator.cc``).

They are thin users of gpupool's C API table (``c_api/table.pyx``), so PyTorch's tensors come from
the device's default pool, as Python's and C's allocations do.
"""
from cpython.ref cimport PyObject
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy
from libcpp.string cimport string
from cuda.bindings.cydriver cimport CUDA_ERROR_OUT_OF_MEMORY
from gpupool.core.defaults cimport pool_of
from gpupool.driver.calls cimport relaxed_capture
from gpupool.history.ring cimport hist_on, hist_subscribe, hist_gather, hist_gathered_done
from gpupool.core.pool cimport Pool, asleep_here
from gpupool.driver.status cimport GPUPOOL_OK, GPUPOOL_ERROR_ASLEEP
from gpupool.capi cimport gpupool_api, gpupool_import

from gpupool.errors import GpupoolError, OutOfMemoryError, SleepingMemoryError

cdef const gpupool_api* _api = gpupool_import()
# The memory history's switch (history/ring.pxd), read by gpupool's C++ allocator too.
cdef public int gpupool_torch_recording = 0
hist_subscribe(&gpupool_torch_recording)

# PyTorch calls a malloc from two places, which treat
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
#   type and message. No PyTorch lock is held there, so the message is built at once, and
#   while the memory history records, the Python frames of the allocation are gathered
#   (taking the GIL, which PyTorch released: PyTorch's own history does the same) for the
#   history's entry. Frees, which PyTorch may make under its lock, get none.

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
                        PyObject** type, string* msg) nogil

_torch_oom_type = OutOfMemoryError      # gpupool.torch sets a torch.OutOfMemoryError subclass
_torch_last_error = None


cdef PyObject* _torch_failure(int status, int device, size_t size,
                              string* msg) noexcept with gil:
    """Describe a failed PyTorch allocation in msg (and count it if out of memory); returns the
    Python exception type to raise (borrowed: a module-level type). Called on the allocating
    thread, so a request refused for its sleeping tag names the thread's current tag."""
    global _torch_last_error
    cdef PyObject* found = pool_of(device)
    cdef Pool pool
    kind = GpupoolError
    try:
        if status == CUDA_ERROR_OUT_OF_MEMORY and found != NULL:
            pool = <Pool>found
            text = pool.oom_failure(size)
            kind = _torch_oom_type
        elif status == GPUPOOL_ERROR_ASLEEP:
            kind = SleepingMemoryError
            text = (f"gpupool: allocating {size} B for PyTorch on device {device} failed: "
                    f"{asleep_here()}")
        else:
            text = (f"gpupool: allocating {size} B for PyTorch on device {device} failed: "
                    f"{_api.error_string(status).decode()} (status {status})")
    except BaseException as e:              # never let the message hide the failure itself
        text = f"gpupool: allocating {size} B for PyTorch on device {device} failed ({e!r})"
    _torch_last_error = text
    msg[0] = text.encode()
    return <PyObject*>kind


cdef public void* gpupool_torch_malloc(size_t size, int device, void* stream) noexcept nogil:
    # PyTorch's caching allocator calls this for a MemPool's segment, during CUDA graph
    # captures too: in the relaxed capture mode, as it does its own cudaMalloc there.
    cdef void* ptr = NULL
    cdef int status, saved = 0
    cdef bint relaxed
    if size == 0:
        return NULL
    relaxed = relaxed_capture(True, &saved) == 0
    status = _api.allocate(device, size, <uintptr_t>stream, &ptr)
    if relaxed:
        relaxed_capture(False, &saved)
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


cdef public int gpupool_torch_allocate_gathering(int device, size_t size, uintptr_t stream,
                                                 void** ptr) noexcept nogil:
    """The C API's allocate for PyTorch's global allocator entry points (no lock of PyTorch's
    held, the GIL not held): while the memory history records, the calling thread's Python
    frames are gathered first (taking the GIL), for the allocation's entries."""
    cdef bint gathered = False
    cdef int status
    if hist_on(gpupool_torch_recording):
        gathered = hist_gather()
    status = _api.allocate(device, size, stream, ptr)
    if gathered:
        hist_gathered_done()
    return status


cdef public void* gpupool_torch_malloc_raising(size_t size, int device,
                                               void* stream) noexcept nogil:
    cdef void* ptr = NULL
    cdef int status
    if size == 0:
        return NULL
    status = gpupool_torch_allocate_gathering(device, size, <uintptr_t>stream, &ptr)
    if status != GPUPOOL_OK:
        _throw_torch_failure(status, device, size)
    return ptr


cdef public void gpupool_torch_free(void* ptr, size_t size, int device,
                                    void* stream) noexcept nogil:
    _api.free(device, ptr, <uintptr_t>stream)


cdef public int gpupool_torch_failure_message(int status, int device, size_t size, char* out,
                                              size_t capacity) noexcept nogil:
    """For gpupool's C++ allocator (src/torch_allocator.cc, which throws PyTorch's own
    out-of-memory error): gpupool's message for a failed allocation, written to out
    (NUL-terminated, cut to capacity bytes); 1 if it was out of memory (then counted in the
    pool's num_ooms), else 0. Takes the GIL."""
    cdef string msg
    cdef size_t n
    _torch_failure(status, device, size, &msg)
    if capacity:
        n = min(msg.size(), capacity - 1)
        memcpy(out, msg.c_str(), n)
        out[n] = 0
    return status == CUDA_ERROR_OUT_OF_MEMORY


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


def _torch_malloc_checked(size_t size, int device=0, uintptr_t stream=0, bint gil=True):
    """Call ``gpupool_torch_malloc_raising`` as PyTorch's Python bindings do: a failure thrown
    as a C++ exception is raised as the Python type it names (``gil`` False: called without
    the GIL, as PyTorch does). Returns the pointer (for tests; free it with ``_torch_free``)."""
    cdef string msg
    cdef PyObject* kind = NULL
    cdef void* ptr
    if gil:
        ptr = gp_torch_call(gpupool_torch_malloc_raising, size, device, <void*>stream, &kind,
                            &msg)
    else:
        with nogil:
            ptr = gp_torch_call(gpupool_torch_malloc_raising, size, device, <void*>stream,
                                &kind, &msg)
    if kind != NULL:
        raise (<object>kind)(msg.decode())
    return <uintptr_t>ptr


def _torch_malloc(size_t size, int device=0, uintptr_t stream=0, bint gil=True):
    """Call ``gpupool_torch_malloc`` (NULL on failure) and return the pointer (for tests;
    ``gil`` False: called without the GIL, as PyTorch does)."""
    cdef void* ptr
    if gil:
        return <uintptr_t>gpupool_torch_malloc(size, device, <void*>stream)
    with nogil:
        ptr = gpupool_torch_malloc(size, device, <void*>stream)
    return <uintptr_t>ptr


def _torch_free(uintptr_t ptr, size_t size=0, int device=0, uintptr_t stream=0, bint gil=True):
    """Call ``gpupool_torch_free`` (for tests; ``gil`` as for ``_torch_malloc``)."""
    if gil:
        gpupool_torch_free(<void*>ptr, size, device, <void*>stream)
    else:
        with nogil:
            gpupool_torch_free(<void*>ptr, size, device, <void*>stream)
