"""PyTorch adapter: PyTorch's CUDA tensors allocated from gpupool.

::

    import torch, gpupool, gpupool.torch
    gpupool.torch.use()                     # every CUDA allocation of the process (call it
                                            # before PyTorch's first CUDA allocation)

    with torch.cuda.use_mem_pool(gpupool.torch.mempool()):
        ...                                 # or: this thread's allocations in this block

Both go through PyTorch's pluggable allocator (``torch.cuda.memory.CUDAPluggableAllocator``)
and the extension's C entry points, which allocate from ``gpupool.get_pool(device)`` for the
device and on the stream PyTorch passes (its current stream). PyTorch is imported when one of
these functions is called, not when this module is.

What each covers
----------------
``use()`` replaces PyTorch's caching allocator: every tensor's memory is a gpupool block,
allocated when the tensor is made and freed when it dies, so ``gpupool.Region`` applies to
tensors as to any allocation. PyTorch runs backward on a thread of its own per device: make the
region with ``scope="process"`` to cover gradients too. PyTorch's pluggable allocator lacks
some of the native one's functions: ``torch.cuda.memory_stats()`` and ``memory_reserved()``
raise (use :func:`memory_stats`), ``torch.cuda.empty_cache()`` does nothing (use
``gpupool.get_pool().trim()``), ``Tensor.record_stream`` is ignored (keep a tensor used on a
side stream alive until that stream's work is done), ``torch.backends.cudnn.benchmark``
needs ``cacheInfo``, which it does not have; ``torch.cuda.memory._record_memory_history`` and
``_snapshot`` do not apply either (use ``gpupool.record_memory_history`` and
``gpupool.dump_snapshot``, whose pickle PyTorch's memory visualizer reads; the entry point
gathers the Python frames of each allocation while it records).

``mempool()`` keeps PyTorch's caching allocator and gives it a ``torch.cuda.MemPool`` whose
segments (2 MiB and up) come from gpupool; PyTorch carves tensors from them and keeps them
cached while the MemPool lives, so a region sees segments, not tensors. ``use_mem_pool``
routes the allocations of the thread that entered it only: backward's thread allocates from
PyTorch's default pool.

Out of memory
-------------
Both ways raise :class:`OutOfMemoryError` (this module's), a subclass of both
``torch.OutOfMemoryError`` and ``gpupool.OutOfMemoryError``, with gpupool's message (request,
bytes in use, reserved, cached, the hard limit; its number attributes are None). Under ``use()`` the
entry point throws a C++ exception that PyTorch's Python bindings translate (PyTorch does not
check the pointer its global pluggable allocator returns). Under ``mempool()`` PyTorch's caching
allocator sees a NULL, frees its cached blocks and retries, and before raising its own error
calls its out-of-memory observers: this module's raises gpupool's error instead
(``torch._C._cuda_attach_out_of_memory_observer``, attached on the first ``mempool()``; where
that is missing PyTorch raises its own ``torch.OutOfMemoryError``, and :func:`last_error`
gives gpupool's message).
"""

import functools

import gpupool
from gpupool import _torch
from gpupool.errors import GpupoolError, NoDeviceError

# OutOfMemoryError subclasses torch's: module __getattr__ makes it on first access.
__all__ = ["OutOfMemoryError", "last_error", "memory_stats", "mempool", "use"]  # noqa: F822

_MALLOC_GLOBAL = "gpupool_torch_malloc_raising"    # throws on failure (see _torch.pyx)
_MALLOC_MEMPOOL = "gpupool_torch_malloc"           # NULL on failure
_FREE = "gpupool_torch_free"

_allocators = {}        # malloc name -> CUDAPluggableAllocator; PyTorch needs it kept alive
_installed = False      # use() swapped PyTorch's global allocator
_observing = False      # the out-of-memory observer is attached

_TOO_LATE = (
    "gpupool.torch.use() must run before PyTorch's first CUDA allocation, but PyTorch has "
    "already initialized CUDA and its own caching allocator, which cannot be replaced "
    "afterwards. Call gpupool.torch.use() at the start of the program, right after "
    "`import torch` and before any tensor is made on the GPU (torch.cuda.is_initialized() "
    "must be False), or route part of the program to gpupool with "
    "`with torch.cuda.use_mem_pool(gpupool.torch.mempool()):`.")


def __getattr__(name):
    if name == "OutOfMemoryError":
        return _oom_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _oom_type():
    """The out-of-memory error both PyTorch and gpupool users catch (made on first use)."""
    import torch

    class OutOfMemoryError(torch.OutOfMemoryError, gpupool.OutOfMemoryError):
        """gpupool ran out of memory serving PyTorch; the message has gpupool's numbers."""

    OutOfMemoryError.__module__ = __name__
    OutOfMemoryError.__qualname__ = "OutOfMemoryError"
    _torch._set_torch_oom_type(OutOfMemoryError)
    return OutOfMemoryError


def _cuda_torch():
    """``torch``, once it has CUDA and sees a device; NoDeviceError otherwise."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ImportError("gpupool.torch needs PyTorch with CUDA: pip install torch") from exc

    if not torch.backends.cuda.is_built():
        raise NoDeviceError(
            f"PyTorch {torch.__version__} was built without CUDA: gpupool.torch needs a CUDA "
            f"build of PyTorch")
    if not torch.cuda.is_available():
        raise NoDeviceError(
            "PyTorch sees no CUDA device (torch.cuda.is_available() is False): no driver, no "
            "GPU, or CUDA_VISIBLE_DEVICES hides them")
    return torch


def _check_pool(pool):
    if not isinstance(pool, gpupool.Pool):
        raise TypeError(f"pool must be a gpupool.Pool, got {type(pool).__name__}")
    if isinstance(pool.upstream, gpupool.testing.SimulatedDevice):
        raise ValueError("a pool on a simulated device holds host memory: it cannot serve "
                         "PyTorch's CUDA tensors")


def _allocator(malloc):
    """The ``CUDAPluggableAllocator`` over the extension's ``malloc`` and free (cached)."""
    allocator = _allocators.get(malloc)
    if allocator is None:
        import torch

        allocator = _allocators[malloc] = torch.cuda.memory.CUDAPluggableAllocator(
            _torch.__file__, malloc, _FREE)
    return allocator


def use(pool=None):
    """Make gpupool PyTorch's CUDA allocator for the whole process.

    Follows ``torch.cuda.memory.change_current_allocator``. Every CUDA tensor made afterwards
    is a block of ``gpupool.get_pool(device)``, allocated on PyTorch's current stream and
    freed when the tensor dies. Calling it again only changes the pool.

    Parameters
    ----------
    pool : gpupool.Pool, optional
        Made the default pool of its device first (``gpupool.set_pool``); default: the
        device's default pool, made on first use.

    Raises
    ------
    GpupoolError
        PyTorch has already initialized CUDA (a tensor was made on the GPU, or
        ``torch.cuda.init()`` ran): its allocator cannot be replaced any more. Run this first,
        or use :func:`mempool`.
    NoDeviceError
        PyTorch was built without CUDA, or sees no device.
    TypeError, ValueError
        ``pool`` is not a ``gpupool.Pool``, or is on a simulated device.

    Notes
    -----
    Out of memory then raises :class:`OutOfMemoryError` from the PyTorch call that
    allocated. See the module's documentation for what PyTorch's pluggable allocator lacks
    (``torch.cuda.memory_stats()``, ``empty_cache()``, ``record_stream``).
    """
    global _installed
    if pool is not None:
        _check_pool(pool)
    torch = _cuda_torch()
    if not _installed:
        if torch.cuda.is_initialized():
            raise GpupoolError(_TOO_LATE)
        _oom_type()
        try:
            torch.cuda.memory.change_current_allocator(_allocator(_MALLOC_GLOBAL))
        except RuntimeError as exc:       # "Can't swap an already initialized allocator"
            raise GpupoolError(_TOO_LATE) from exc
        _installed = True
    if pool is not None:
        gpupool.set_pool(pool)


def mempool(pool=None):
    """A ``torch.cuda.MemPool`` whose memory comes from gpupool.

    For ``with torch.cuda.use_mem_pool(gpupool.torch.mempool()):``. PyTorch's caching
    allocator serves the block's tensors from segments it allocates from
    ``gpupool.get_pool(device)`` on its current stream.

    Parameters
    ----------
    pool : gpupool.Pool, optional
        Made the default pool of its device first (``gpupool.set_pool``); the entry points
        always draw from the default pool of the device PyTorch allocates on.

    Returns
    -------
    torch.cuda.MemPool
        A new pool each call, all backed by one pluggable allocator.

    Raises
    ------
    GpupoolError
        After :func:`use`, which already routes every allocation to gpupool.
    NoDeviceError
        PyTorch was built without CUDA, or sees no device.
    TypeError, ValueError
        ``pool`` is not a ``gpupool.Pool``, or is on a simulated device.

    Notes
    -----
    Out of memory inside the block raises :class:`OutOfMemoryError` with gpupool's message
    (through PyTorch's out-of-memory observers, attached on the first call).
    """
    if pool is not None:
        _check_pool(pool)
    torch = _cuda_torch()
    if _installed:
        raise GpupoolError(
            "gpupool.torch.use() already routes every PyTorch allocation to gpupool; "
            "mempool() is for programs that keep PyTorch's own allocator")
    if pool is not None:
        gpupool.set_pool(pool)
    _observe_oom(torch)
    return torch.cuda.MemPool(_allocator(_MALLOC_MEMPOOL).allocator())


def _observe_oom(torch):
    global _observing
    if _observing:
        return
    _oom_type()
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(_on_torch_oom)
    _observing = True


def _on_torch_oom(device, alloc_size, device_total, device_free):
    """PyTorch's caching allocator is about to raise out of memory; if gpupool refused it the
    segment (this thread's last MemPool allocation failed), raise gpupool's error instead."""
    failure = _torch._take_torch_failure(device)
    if failure is not None:
        kind, message = failure
        raise kind(message)


def memory_stats(device=None):
    """The gpupool pool's counters under the keys of ``torch.cuda.memory_stats()``.

    Parameters
    ----------
    device : int, str or torch.device, optional
        A CUDA device (``0``, ``"cuda:0"``, ``torch.device("cuda", 0)``); default: the current
        one (the CUDA context current on the thread, which ``torch.cuda.set_device`` sets).

    Returns
    -------
    dict
        See ``gpupool.Pool.memory_stats``; bytes and counts.

    Raises
    ------
    NoDeviceError
        No driver or no such device (and no pool given to ``gpupool.set_pool`` for it).
    ValueError
        ``device`` is not a CUDA device.
    """
    return gpupool.get_pool(_device_index(device)).memory_stats()


def _device_index(device):
    """Ordinal of a device given as None, an int, a string or a torch.device (None: current)."""
    if device is None or isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"memory_stats needs a CUDA device, got {device}")
    return device.index


def last_error():
    """gpupool's message for the last allocation it refused PyTorch (any thread), or None."""
    return _torch._torch_last_failure()
