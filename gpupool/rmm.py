"""RMM adapter: every RMM allocation a gpupool block.

::

    import rmm, gpupool, gpupool.rmm
    gpupool.rmm.use()                       # the current device's RMM resource: gpupool
    buf = rmm.DeviceBuffer(size=1 << 20)    # a block of gpupool.get_pool()

    mr = gpupool.rmm.resource(pool)         # or a resource to pass around, over `pool`
    rmm.DeviceBuffer(size=n, mr=mr)

What it covers
--------------
``use()`` makes a gpupool resource the current device's RMM resource
(``rmm.mr.set_per_device_resource``), so every allocation RMM makes for that device is a block
of the pool: ``rmm.DeviceBuffer``, cuDF's columns, ``rmm.allocators.cupy.rmm_cupy_allocator``,
``rmm.allocators.numba`` and ``rmm.allocators.torch.rmm_torch_allocator``. A block is allocated on
the stream RMM names (``DeviceBuffer``'s ``stream``, the legacy default stream unless given),
handed out by pointer as gpupool's C API hands blocks out, and freed as last used on the
stream RMM frees it on; so it counts in the pool's statistics, a ``gpupool.Region`` entered
on the allocating thread caches it, and snapshots and the memory history show it. Out of
memory raises ``MemoryError`` from RMM's calls (RMM turns gpupool's ``OutOfMemoryError``, a
``MemoryError``, into ``rmm::out_of_memory``, which reaches Python as ``MemoryError`` with
gpupool's message), after the pool's ``on_oom`` callbacks; it counts in ``num_ooms``.

How
---
The resource is an ``rmm.mr.CallbackMemoryResource`` (the subclass :func:`resource`
returns) whose two functions are compiled (``gpupool.adapters.rmm_entry``): RMM calls them
with the GIL and a fresh ``Stream`` each time, so an allocation costs RMM's Python round trip
on top of gpupool's (``bench/rmm_resource.py`` measures it against RMM's own pool).

Only this route exists; a resource in C++ (RMM's ``callback_memory_resource`` over the C
API's functions, no GIL or Python call per allocation) would be a Cython class deriving from
RMM's ``DeviceMemoryResource``, compiled against the installed RMM, so on first use and with
Cython at run time: see Note [RMM resource route] in docs/design.md.

RMM is imported when a resource is made, not when this module is.
"""

import functools

import gpupool
from gpupool.adapters.rmm_entry import RmmCallbacks
from gpupool.core.pool import Pool
from gpupool.errors import refuse_host_memory
from gpupool.public import public_dir

__all__ = ["resource", "use"]


def __dir__():
    """The public API and the module's dunder attributes, not the names it imports."""
    return public_dir(globals(), __all__)

_FIX = "pip install 'gpupool[rmm]' (RMM's wheel for CUDA 13, rmm-cu13)"


def _rmm():
    try:
        import rmm.mr
    except ImportError as e:
        raise ImportError(f"gpupool.rmm needs RMM, which is not importable here ({e}): "
                          f"{_FIX}") from e
    return rmm


@functools.cache
def _resource_class(callback_resource):
    class Resource(callback_resource):
        """An ``rmm.mr.CallbackMemoryResource`` over a gpupool pool (``gpupool.rmm``)."""

        def __init__(self, callbacks):
            super().__init__(callbacks.allocate, callbacks.deallocate)
            self._callbacks = callbacks

        @property
        def pool(self):
            """The ``gpupool.Pool`` every allocation comes from."""
            return self._callbacks.pool

        def __repr__(self):
            return f"<gpupool.rmm resource over {self.pool!r}>"

    Resource.__module__ = __name__
    Resource.__qualname__ = "Resource"
    return Resource


def resource(pool=None, device=None):
    """An RMM device memory resource whose allocations are blocks of a gpupool pool.

    Parameters
    ----------
    pool : gpupool.Pool, optional
        The pool to draw from; default: ``gpupool.get_pool(device)``, fixed when the resource
        is made (a later ``gpupool.set_pool`` needs a new resource).
    device : int, optional
        The device, when ``pool`` is not given; default: the calling thread's current device
        (its current CUDA context's, else 0). With ``pool``, it must be the pool's.

    Returns
    -------
    rmm.mr.CallbackMemoryResource
        A subclass of it with a ``pool`` attribute. ``allocate(nbytes, stream)`` takes a block
        of ``pool`` ready for work on ``stream`` (zero bytes: the null pointer);
        ``deallocate(ptr, nbytes, stream)`` frees it as last used on ``stream``. Pass it as
        ``mr=`` to RMM, or to ``rmm.mr.set_per_device_resource(pool.device, mr)``
        (:func:`use`); use it for ``pool``'s device only, as RMM's own resources.

    Raises
    ------
    ImportError
        RMM is not installed (the message names the extra to install).
    TypeError
        ``pool`` is not a ``gpupool.Pool``, ``device`` not an int.
    ValueError
        ``pool`` is on a simulated device (host memory), or on another device than ``device``.
    gpupool.NoDeviceError
        No driver, or no such device (making the default pool).

    The resource's allocations raise ``MemoryError`` for out of memory (RMM's translation of
    gpupool's ``OutOfMemoryError``, with its message) and ``RuntimeError`` for anything else
    (RMM's translation of a ``gpupool.GpupoolError``), from ``rmm.DeviceBuffer`` and RMM's other
    callers.
    """
    if pool is not None:
        _check_pool(pool, device)
    rmm = _rmm()
    if pool is None:
        pool = gpupool.get_pool(device)
        _check_pool(pool, device)
    return _resource_class(rmm.mr.CallbackMemoryResource)(RmmCallbacks(pool))


def use(pool=None, device=None):
    """Make a gpupool resource (:func:`resource`) the RMM resource of the pool's device.

    Every RMM allocation for that device made afterwards (``rmm.DeviceBuffer``, cuDF, RMM's
    CuPy, Numba and PyTorch allocators) is a block of the pool; buffers made before keep the
    resource that made them.

    Parameters
    ----------
    pool, device
        As for :func:`resource`.

    Returns
    -------
    rmm.mr.CallbackMemoryResource
        The resource set (``rmm.mr.set_per_device_resource(resource.pool.device, resource)``).

    Raises
    ------
    As :func:`resource`.
    """
    mr = resource(pool, device)
    _rmm().mr.set_per_device_resource(mr.pool.device, mr)
    return mr


def _check_pool(pool, device):
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a gpupool.Pool or None, got {type(pool).__name__}")
    if device is not None:
        if type(device) is not int:
            raise TypeError(f"device must be an int or None, got {type(device).__name__}")
        if device != pool.device:
            raise ValueError(f"the pool is on device {pool.device}, not device {device}")
    refuse_host_memory(pool, "RMM's device allocations")
