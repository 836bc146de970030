"""Host sources of ``DeviceBuffer.copy_from_host``: any object with the buffer protocol, seen
as contiguous bytes."""

import numpy as np

__all__ = ["host_bytes"]


def host_bytes(src):
    """The bytes of a host source as a contiguous uint8 array (a view where possible)."""
    if isinstance(src, str) or not (isinstance(src, np.ndarray) or _has_buffer(src)):
        raise TypeError(
            f"copy_from_host needs a numpy array, a bytes-like object or a device array, "
            f"got {type(src).__name__}")
    array = np.asarray(src)
    if array.dtype.hasobject:
        raise TypeError("copy_from_host cannot copy an array of Python objects")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _has_buffer(obj):
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True
