"""gpupool's C API table (gpupool/include/gpupool.h) seen through ctypes, for tests that call
its functions from Python: the layout below is the header's, written once more from outside,
so a test that checks ``sizeof`` against the table's own ``size`` checks the header's order.

``api()`` returns the table; ``call(name, *args)`` calls one of its functions and returns its
status code; the out-parameter helpers (``out_ptr`` ...) make the ctypes objects to pass.
"""

import ctypes as C

import gpupool._capi

_I, _P, _U, _S = C.c_int, C.c_void_p, C.c_size_t, C.c_size_t     # uintptr_t, size_t: 64-bit
_PS, _PU, _PP = C.POINTER(_S), C.POINTER(_U), C.POINTER(_P)

# GPUPOOL_ERROR_ASLEEP (include/gpupool_status.h): a request made while the calling thread's
# tag sleeps.
ASLEEP = 100005

STATS_FIELDS = ("in_use_bytes", "peak_in_use_bytes", "reserved_bytes", "peak_reserved_bytes",
                "cached_bytes", "num_allocs", "num_frees", "cache_hits", "cache_misses",
                "upstream_allocs", "upstream_frees", "oom_retries", "num_ooms",
                "allocated_bytes", "freed_bytes")


class Stats(C.Structure):
    _fields_ = [(name, _S) for name in STATS_FIELDS]


class Table(C.Structure):
    _fields_ = [
        ("version", C.c_uint), ("size", C.c_uint),
        ("allocate", C.CFUNCTYPE(_I, _I, _S, _U, _PP)),
        ("free", C.CFUNCTYPE(_I, _I, _P, _U)),
        ("record_stream", C.CFUNCTYPE(_I, _I, _P, _U)),
        ("get_stats", C.CFUNCTYPE(_I, _I, C.POINTER(Stats))),
        ("error_string", C.CFUNCTYPE(C.c_char_p, _I)),
        ("free_ptr", C.CFUNCTYPE(_I, _I, _P)),
        ("trim", C.CFUNCTYPE(_I, _I, _PS)),
        ("reset_peaks", C.CFUNCTYPE(_I, _I)),
        ("cache_info", C.CFUNCTYPE(_I, _I, _PS, _PS)),
        ("base_allocation", C.CFUNCTYPE(_I, _I, _P, _PU, _PS)),
        ("private_new", C.CFUNCTYPE(_I, _I, _PP)),
        ("private_allocate", C.CFUNCTYPE(_I, _P, _S, _U, _PP)),
        ("private_live", C.CFUNCTYPE(_I, _P, _PU, _PS, _S, _PS)),
        ("private_allocate_at", C.CFUNCTYPE(_I, _P, _P, _S, _U)),
        ("private_destroy", C.CFUNCTYPE(_I, _P)),
    ]


def api():
    """The table the capsule ``gpupool._capi._C_API`` points to."""
    get = C.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = C.c_void_p, [C.py_object, C.c_char_p]
    return Table.from_address(get(gpupool._capi._C_API, b"gpupool._capi._C_API"))


def call(name, *args):
    return getattr(api(), name)(*args)


def allocate(nbytes, device=0, stream=0):
    """``allocate``: the pointer (an int); raises AssertionError with the status otherwise."""
    ptr = _P()
    status = call("allocate", device, nbytes, stream, C.byref(ptr))
    assert status == 0, f"allocate({nbytes}) returned {status}"
    return ptr.value


def private_new(device=0):
    handle = _P()
    status = call("private_new", device, C.byref(handle))
    assert status == 0, f"private_new returned {status}"
    return handle


def private_allocate(handle, nbytes, stream=0):
    """``private_allocate``: ``(status, pointer)``."""
    ptr = _P()
    return call("private_allocate", handle, nbytes, stream, C.byref(ptr)), ptr.value


def private_live(handle):
    """``private_live``: a sorted list of ``(pointer, bytes)``."""
    count = _S()
    assert call("private_live", handle, None, None, 0, C.byref(count)) == 0
    n = count.value
    ptrs, sizes = (_U * max(n, 1))(), (_S * max(n, 1))()
    assert call("private_live", handle, ptrs, sizes, n, C.byref(count)) == 0
    return sorted(zip(ptrs[:n], sizes[:n], strict=True))


def stats(device=0):
    out = Stats()
    assert call("get_stats", device, C.byref(out)) == 0
    return {name: getattr(out, name) for name in STATS_FIELDS}


def size_out():
    return _S()


def ptr_out():
    return _U()
