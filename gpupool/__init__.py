"""gpupool: a caching GPU memory allocator for every Python array library.

One pool per device serves ``DeviceBuffer`` objects (CUDA Array Interface v3) from size-binned
free lists with stream-ordered reuse; ``Region`` caches a block of code's allocations across
iterations with a peak equal to its working set.
"""

import os
import threading

from gpupool import (
    _capi,  # noqa: F401  (publishes the C API capsule)
    testing,
)
from gpupool._buffer import DeviceBuffer, as_buffer
from gpupool._driver import current_device as _current_device
from gpupool._pool import Pool, on_oom, remove_oom_callback, size_class, uncached
from gpupool._region import Region
from gpupool._upstream import AsyncUpstream, DriverUpstream, PythonUpstream, Upstream
from gpupool.errors import (
    CudaError,
    GpupoolError,
    InvalidBufferError,
    NoDeviceError,
    OutOfMemoryError,
)
from gpupool.stats import PoolStats, RegionStats, format_status

__version__ = "0.1.0"

__all__ = [
    "AsyncUpstream",
    "CudaError",
    "DeviceBuffer",
    "DriverUpstream",
    "GpupoolError",
    "InvalidBufferError",
    "NoDeviceError",
    "OutOfMemoryError",
    "Pool",
    "PoolStats",
    "PythonUpstream",
    "Region",
    "RegionStats",
    "allocate",
    "as_buffer",
    "get_include",
    "get_pool",
    "on_oom",
    "pool_status",
    "set_pool",
    "remove_oom_callback",
    "size_class",
    "testing",
    "uncached",
    "Upstream",
]

_pools: dict[int, Pool] = {}
_retired: list[Pool] = []    # replaced default pools: C code may still hold their memory
_pools_lock = threading.Lock()


def get_pool(device=None):
    """The default pool of a device (made on first use, on the driver upstream).

    Parameters
    ----------
    device : int, optional
        Device ordinal; default: the device of the calling thread's current CUDA context,
        or 0 when there is none (or no driver, once ``set_pool`` gave device 0 a pool).

    Returns
    -------
    Pool

    Raises
    ------
    NoDeviceError
        No driver, or no such device.
    """
    if device is None:
        try:
            device = _current_device()
        except NoDeviceError:
            if 0 not in _pools:
                raise
            device = 0
    pool = _pools.get(device)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(device)
            if pool is None:
                pool = _pools[device] = Pool(device=device)
    return pool


def set_pool(pool, device=None):
    """Make ``pool`` the default pool of its device (or of ``device``), for ``get_pool``,
    ``allocate``, regions made without a pool, the adapters and the C API.

    Parameters
    ----------
    pool : Pool
        For example ``Pool(upstream=gpupool.testing.SimulatedDevice())`` in tests.
    device : int, optional
        Default: ``pool.device``.
    """
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
    device = pool.device if device is None else device
    with _pools_lock:
        if device in _pools:
            _retired.append(_pools[device])
        _pools[device] = pool
        _capi._forget(device)


def get_include():
    """Folder of ``gpupool.h``, the C API header, for an extension's ``include_dirs``."""
    return os.path.join(os.path.dirname(__file__), "include")


def allocate(nbytes, stream=None, device=None):
    """Allocate from the default pool of ``device``; see :meth:`Pool.allocate`.

    Parameters
    ----------
    nbytes : int
        Bytes, >= 0.
    stream : int, stream object or None
        Stream the buffer is used on (None: the legacy default stream).
    device : int, optional
        Device ordinal; default: the current device.

    Returns
    -------
    DeviceBuffer
    """
    return get_pool(device).allocate(nbytes, stream)


def pool_status(device=None, pool=None):
    """Print the device's memory use and the pool's, in the familiar two-line form::

        Effective GPU memory usage: 2.98% (716.688 MiB/23.465 GiB)
        Memory pool usage: 1.586 MiB (32.000 MiB reserved)

    Parameters
    ----------
    device : int, optional
        Report on this device's default pool.
    pool : Pool, optional
        Report on this pool instead.
    """
    pool = get_pool(device) if pool is None else pool
    free, total = pool.mem_info()
    stats = pool.stats()
    print(format_status(free, total, stats.in_use_bytes, stats.reserved_bytes))
