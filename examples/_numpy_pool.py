"""NumPy arrays whose memory comes from a gpupool Pool of host memory, such as a pool on
``gpupool.testing.SimulatedDevice``: the CPU counterpart of ``cupy.cuda.using_allocator``.

::

    pool = gpupool.Pool(upstream=SimulatedDevice())
    with using_pool(pool):
        a = np.ones((64, 128), np.float32)     # a's memory is a DeviceBuffer of `pool`
        b = a @ a.T                            # so is every temporary and result

It sets NumPy's data memory handler (NEP 49, ``PyDataMem_SetHandler``, NumPy >= 1.22) to C
callbacks made with ctypes. Each array NumPy creates while a pool is current takes its memory
from ``pool.allocate``; the ``DeviceBuffer`` is kept until NumPy frees the array, then dropped,
so its block returns to the pool, or to the region that served it, exactly when the array dies
(in a reference cycle: when the collector frees it). Regions apply as to any allocation.
"""

import contextlib
import contextvars
import ctypes

try:
    from numpy._core import _multiarray_umath
except ImportError:  # NumPy 1.x
    from numpy.core import _multiarray_umath

__all__ = ["using_pool"]

# Slot of PyDataMem_SetHandler in NumPy's C API table (numpy/__multiarray_api.h); the slots are
# NumPy's ABI and do not move between releases.
_SET_HANDLER_SLOT = 304
_HANDLER_NAME = b"gpupool"

_size = ctypes.c_size_t
_ptr = ctypes.c_void_p
_MALLOC = ctypes.CFUNCTYPE(_ptr, _ptr, _size)
_CALLOC = ctypes.CFUNCTYPE(_ptr, _ptr, _size, _size)
_REALLOC = ctypes.CFUNCTYPE(_ptr, _ptr, _ptr, _size)
_FREE = ctypes.CFUNCTYPE(None, _ptr, _ptr, _size)


class _Allocator(ctypes.Structure):
    """``PyDataMemAllocator`` (numpy/ndarraytypes.h, version 1)."""

    _fields_ = [("ctx", _ptr), ("malloc", _MALLOC), ("calloc", _CALLOC),
                ("realloc", _REALLOC), ("free", _FREE)]


class _Handler(ctypes.Structure):
    """``PyDataMem_Handler`` (numpy/ndarraytypes.h)."""

    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8),
                ("allocator", _Allocator)]


_libc = ctypes.CDLL(None)
for _name, _restype, _argtypes in (("malloc", _ptr, [_size]), ("calloc", _ptr, [_size, _size]),
                                   ("realloc", _ptr, [_ptr, _size]), ("free", None, [_ptr])):
    getattr(_libc, _name).restype = _restype
    getattr(_libc, _name).argtypes = _argtypes

# The pool serving the current context; None inside the pool's own allocation (the simulated
# device makes NumPy arrays there), and wherever no `using_pool` is active: the C library then
# serves NumPy, as its default handler would.
_current_pool = contextvars.ContextVar("gpupool_numpy_pool", default=None)
_buffers = {}  # pointer -> DeviceBuffer holding it, for every live array of a pool


def _from_pool(nbytes):
    """A pool pointer for ``nbytes``; 0 when the pool fails; None when no pool is current."""
    pool = _current_pool.get()
    if pool is None:
        return None
    token = _current_pool.set(None)
    try:
        buf = pool.allocate(max(nbytes, 1))
    except Exception:  # noqa: BLE001 -- NumPy raises its MemoryError for a NULL result
        return 0
    finally:
        _current_pool.reset(token)
    _buffers[buf.ptr] = buf
    return buf.ptr


def _malloc(ctx, nbytes):
    ptr = _from_pool(nbytes)
    return _libc.malloc(nbytes) if ptr is None else ptr


def _calloc(ctx, count, itemsize):
    ptr = _from_pool(count * itemsize)
    if ptr is None:
        return _libc.calloc(count, itemsize)
    if ptr:
        ctypes.memset(ptr, 0, count * itemsize)  # a cached block holds its last user's bytes
    return ptr


def _realloc(ctx, ptr, nbytes):
    old = _buffers.get(ptr)
    if old is None and ptr:
        return _libc.realloc(ptr, nbytes)
    new = _malloc(ctx, nbytes)
    if new and old is not None:
        ctypes.memmove(new, ptr, min(nbytes, old.nbytes))
        del _buffers[ptr]
    return new


def _free(ctx, ptr, nbytes):
    try:
        if _buffers.pop(ptr, None) is None and ptr:
            _libc.free(ptr)
    except BaseException:  # noqa: BLE001 -- at interpreter exit the module may be half gone
        pass


# NumPy keeps a reference to the handler in every array it allocated, and calls its free when
# the array dies, whenever that is: the struct, its callbacks and the capsule live as long as
# the process.
_callbacks = (_MALLOC(_malloc), _CALLOC(_calloc), _REALLOC(_realloc), _FREE(_free))
_handler = _Handler(_HANDLER_NAME, 1, _Allocator(None, *_callbacks))
_capsule_name = b"mem_handler"  # the capsule keeps this pointer: keep the bytes too
ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [_ptr, ctypes.c_char_p, _ptr]
_capsule = ctypes.pythonapi.PyCapsule_New(ctypes.addressof(_handler), _capsule_name, None)


def _set_handler_function():
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = _ptr
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    table = get_pointer(_multiarray_umath._ARRAY_API, None)
    address = (_ptr * (_SET_HANDLER_SLOT + 1)).from_address(table)[_SET_HANDLER_SLOT]
    return ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(address)


_set_handler = _set_handler_function()


@contextlib.contextmanager
def using_pool(pool):
    """Serve NumPy's array memory from ``pool`` in the current context (thread) while entered.

    Parameters
    ----------
    pool : gpupool.Pool
        A pool of host memory: its upstream declares ``host_accessible`` (as
        ``gpupool.testing.SimulatedDevice`` does).

    Raises
    ------
    ValueError
        The pool's memory is not host memory (NumPy cannot compute on device memory).

    Notes
    -----
    Arrays made while entered keep their memory after the block exits, until they die; arrays
    made elsewhere are untouched. A failed ``pool.allocate`` (out of memory, for one) makes
    NumPy raise its own ``MemoryError``. Nested blocks restore the outer pool at exit.
    """
    if not pool.upstream.host_accessible:
        raise ValueError(f"NumPy needs a pool of host memory, not one on {pool.upstream!r}")
    token = _current_pool.set(pool)
    previous = _set_handler(_capsule)
    try:
        yield pool
    finally:
        _set_handler(previous)
        _current_pool.reset(token)

