"""gpupool: a caching GPU memory allocator for every Python array library.

One pool per device serves ``DeviceBuffer`` objects (CUDA Array Interface v3) from size-binned
free lists with stream-ordered reuse; ``Region`` caches a block of code's allocations across
iterations with a peak equal to its working set.
"""

from gpupool import (
    _capi,  # noqa: F401  (publishes the C API capsule)
    testing,
)
from gpupool.buffer.device_buffer import DeviceBuffer
from gpupool.core.defaults import _pools, get_pool, set_pool  # noqa: F401  (_pools: the registry)
from gpupool.core.pool import Pool, tag, uncached
from gpupool.core.poolbase import size_class
from gpupool.core.oom import on_oom, remove_oom_callback
from gpupool.region.region import Region
from gpupool.upstream.base import Upstream
from gpupool.upstream.driver import DriverUpstream
from gpupool.upstream.mempool import AsyncUpstream
from gpupool.upstream.python import PythonUpstream
from gpupool.upstream.vmm import VmmUpstream
from gpupool.errors import (
    CudaError,
    GpupoolError,
    InvalidBufferError,
    IpcError,
    NoDeviceError,
    OutOfMemoryError,
    SleepingMemoryError,
)
from gpupool.interop import as_buffer
from gpupool.ipc import IpcHandle, open_ipc
from gpupool.snapshot import dump_snapshot, memory_snapshot, record_memory_history
from gpupool.stats import PoolStats, RegionStats
from gpupool.stats import format_status as _format_status

__version__ = "0.1.0"

__all__ = [
    "AsyncUpstream",
    "CudaError",
    "DeviceBuffer",
    "DriverUpstream",
    "GpupoolError",
    "InvalidBufferError",
    "IpcError",
    "IpcHandle",
    "NoDeviceError",
    "OutOfMemoryError",
    "Pool",
    "PoolStats",
    "PythonUpstream",
    "Region",
    "RegionStats",
    "SleepingMemoryError",
    "allocate",
    "as_buffer",
    "dump_snapshot",
    "get_include",
    "get_pool",
    "memory_snapshot",
    "on_oom",
    "open_ipc",
    "pool_status",
    "record_memory_history",
    "set_pool",
    "remove_oom_callback",
    "size_class",
    "tag",
    "testing",
    "uncached",
    "Upstream",
    "VmmUpstream",
]

# The modules a user imports by name; dir() lists those that are imported.
_PUBLIC_MODULES = ("cupy", "diagnose", "numba", "testing", "torch")


def __dir__():
    """The public API, the imported public modules and the module's dunder attributes: not
    the internal modules (core, buffer, ...) that importing the package binds."""
    names = globals()
    return sorted({*__all__, *(m for m in _PUBLIC_MODULES if m in names),
                   *(n for n in names if n.startswith("__") and n.endswith("__"))})


def get_include():
    """Folder of ``gpupool.h``, the C API header, for an extension's ``include_dirs``."""
    from os import path

    return path.join(path.dirname(__file__), "include")


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

    On the simulated device (an upstream of host memory) the first line reads
    ``Simulated device memory usage: ...``: the figures are the simulated device's, not a GPU's.

    Parameters
    ----------
    device : int, optional
        Report on this device's default pool.
    pool : Pool, optional
        Report on this pool instead.

    Raises
    ------
    TypeError
        ``pool`` is not a ``gpupool.Pool``.
    """
    if pool is None:
        pool = get_pool(device)
    elif not isinstance(pool, Pool):
        raise TypeError(f"pool_status(pool=) takes a gpupool.Pool, got {type(pool).__name__}")
    free, total = pool.mem_info()
    stats = pool.stats()
    print(_format_status(free, total, stats.in_use_bytes, stats.reserved_bytes,
                         simulated=pool.upstream.host_accessible))
