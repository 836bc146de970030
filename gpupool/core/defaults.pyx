# cython: language_level=3
"""The default pool of each device: ``gpupool.get_pool`` / ``gpupool.set_pool``, and the same
pools for C code (the C API and the PyTorch entry points look them up without the GIL)."""
import threading

from cpython.dict cimport PyDict_GetItem
from cpython.ref cimport PyObject
from gpupool.driver.calls import current_device
from gpupool.driver.ordinals import check_ordinal
from gpupool.core.pool cimport Pool

from gpupool.buffer.hooks import install_pool_source
from gpupool.errors import NoDeviceError

# Borrowed from _pools: a default pool, once made, is kept for the process's life (replaced
# ones in _retired, since C code may still hold their memory).
cdef PyObject* _table[MAX_DEVICES]

_pools: dict[int, Pool] = {}
_retired: list[Pool] = []
_lock = threading.Lock()


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
    TypeError, ValueError
        An impossible ``device`` (a bool, not an int, negative), as ``Pool`` refuses it.
    """
    if device is None:
        try:
            device = current_device()
        except NoDeviceError:
            if 0 not in _pools:
                raise
            device = 0
    elif type(device) is not int or device < 0:
        device = check_ordinal(device)  # a bool would find device 1's pool
    pool = _pools.get(device)
    if pool is None:
        with _lock:
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
    with _lock:
        if device in _pools:
            _retired.append(_pools[device])
        _pools[device] = pool
        _forget(device)


def _forget(int device):
    """Drop C code's cached pointer to a device's default pool (after the registry changed)."""
    if 0 <= device < MAX_DEVICES:
        _table[device] = NULL


cdef PyObject** pool_table() noexcept nogil:
    return _table


cdef PyObject* _lookup(int device) noexcept with gil:
    try:
        pool = get_pool(device)
    except Exception:
        return NULL
    return <PyObject*>pool


cdef PyObject* pool_of(int device) noexcept nogil:
    """The default pool of a device (borrowed), made with the GIL on first use; NULL if none
    can be had (no driver, no such device)."""
    if device < 0 or device >= MAX_DEVICES:
        return NULL
    if _table[device] == NULL:
        _table[device] = _lookup(device)
    return _table[device]


cdef PyObject* registered_pool(int device) noexcept:
    """The default pool of a device if it has one (borrowed; with the GIL), else NULL; makes
    none."""
    return PyDict_GetItem(_pools, device)


install_pool_source(get_pool)     # the pool that unpickled buffers are allocated from
