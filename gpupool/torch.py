"""PyTorch adapter: PyTorch's CUDA tensors allocated from gpupool.

::

    import torch, gpupool, gpupool.torch
    gpupool.torch.use()                     # every CUDA allocation of the process (call it
                                            # before PyTorch's first CUDA allocation)

    with torch.cuda.use_mem_pool(gpupool.torch.mempool()):
        ...                                 # or: this thread's allocations in this block

PyTorch is imported when one of these functions is called, not when this module is.

What each covers
----------------
``use()`` replaces PyTorch's caching allocator: every tensor's memory is a block of
``gpupool.get_pool(device)``, allocated on PyTorch's current stream when the tensor is made and
freed when it dies, so ``gpupool.Region`` applies to tensors as to any allocation. PyTorch runs
backward on a thread of its own per device: make the region with ``scope="process"`` to cover
gradients too. The allocator is gpupool's own C++ class (``src/torch_allocator.cc``), compiled
on first use against the installed PyTorch (``adapters/torch_allocator.py``; a few seconds, then
cached), so PyTorch keeps what its own allocator offers: ``torch.cuda.memory_stats()``,
``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()`` and
``reset_peak_memory_stats()`` report gpupool's counters, ``empty_cache()`` gives the pool's
cached memory back (``Pool.trim()``), ``Tensor.record_stream`` keeps a block from other streams
until the recorded stream's work is ordered, ``torch.backends.cudnn.benchmark`` gets its
workspace limit, and CUDA graphs (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
and ``torch.cuda.MemPool`` get private memory pools: gpupool private pools, whose memory stays
the graph's, at the same addresses for every replay, until the graph is gone.

When the C++ allocator cannot be built or loaded (no C++ compiler, no CUDA headers, an
unexpected PyTorch), ``use()`` warns once, saying why and what to do, and falls back to
PyTorch's pluggable allocator (``torch.cuda.memory.CUDAPluggableAllocator``) over the
extension's C entry points: malloc and free only, so ``torch.cuda.memory_stats()`` raises (use
:func:`memory_stats`), ``empty_cache()`` does nothing (use ``gpupool.get_pool().trim()``),
``record_stream`` is ignored, CUDA graphs and cuDNN's benchmark fail.
``GPUPOOL_TORCH_ALLOCATOR=pluggable`` chooses that route without the warning;
:func:`allocator` says which one is installed, and ``python -m gpupool`` beforehand whether
it is built, still to be built, or why it cannot be.
``torch.cuda.memory._record_memory_history`` and ``_snapshot`` do not apply: use
``gpupool.record_memory_history`` and ``gpupool.dump_snapshot``, whose pickle PyTorch's memory
visualizer reads (the entry point gathers the Python frames of each allocation while it
records).

``mempool()`` keeps PyTorch's caching allocator and gives it a ``torch.cuda.MemPool`` whose
segments (2 MiB and up) come from gpupool; PyTorch carves tensors from them and keeps them
cached while the MemPool lives, so a region sees segments, not tensors. ``use_mem_pool``
routes the allocations of the thread that entered it only: backward's thread allocates from
PyTorch's default pool.

Sharing tensors between processes
---------------------------------
``torch.multiprocessing`` shares a CUDA tensor through its allocator's CUDA IPC handle
(``storage._share_cuda_()``, PyTorch's caching allocator's ``shareIpcHandle``): under
``use()`` PyTorch's pluggable allocator has none (the producer gets "CUDAPluggableAllocator
does not yet support shareIPcHandle", a consumer "... getIpcDevPtr"), and under ``mempool()``
PyTorch would export a handle of its segment as if it were a whole ``cudaMalloc``
allocation, which a gpupool block is not (it may be a piece of a larger driver allocation,
or virtual-memory pages that ``cudaIpcGetMemHandle`` refuses). So ``use()`` and
``mempool()`` register a reducer of their own with ``multiprocessing``'s ``ForkingPickler``:
a CUDA tensor whose memory is a gpupool block is sent as a gpupool IPC handle
(``gpupool.ipc``: the block's allocation, the storage's offset in it, an event recorded on
PyTorch's current stream of the pickling thread, as PyTorch's own sharing records it:
``multiprocessing`` queues pickle in a feeder thread, where that is the default stream, so
synchronize a side stream that wrote the tensor before sending it, as with PyTorch's) and
rebuilt in the receiving process over ``gpupool.open_ipc``
(``torch.from_dlpack``, with the dtype, size, stride and storage offset), whatever allocator
that process uses; other tensors go through PyTorch's own reducer. PyTorch's rule applies:
keep the sent tensor alive until the receiver is done with it (its storage's death
releases the export: a later open raises ``gpupool.IpcError``). A tensor received this
way cannot be sent on (clone it first), as in PyTorch. A process under ``use()`` that
receives a tensor of PyTorch's own allocator from another process gets a
``gpupool.IpcError`` naming the way out (``mempool()`` there, or gpupool in the sender).

Out of memory
-------------
Under ``use()`` with gpupool's allocator, out of memory raises ``torch.OutOfMemoryError`` (in
C++ a ``c10::OutOfMemoryError``, which PyTorch's own fallbacks, such as cuDNN's for its
workspaces, catch) with gpupool's message: request, bytes in use, reserved, cached, the hard
limit; :func:`last_error` gives it too. The pluggable route and ``mempool()`` raise
:class:`OutOfMemoryError` (this module's), a subclass of both ``torch.OutOfMemoryError`` and
``gpupool.OutOfMemoryError``, with the same message. On the pluggable route the entry point
throws a C++ exception that PyTorch's Python bindings translate (PyTorch does not check the
pointer its global pluggable allocator returns). Under ``mempool()`` PyTorch's caching
allocator sees a NULL, frees its cached blocks and retries, and before raising its own error
calls its out-of-memory observers: this module's raises gpupool's error instead
(``torch._C._cuda_attach_out_of_memory_observer``, attached on the first ``mempool()``; where
that is missing PyTorch raises its own ``torch.OutOfMemoryError``, and :func:`last_error`
gives gpupool's message).
"""

import functools
import os
import sys
import warnings

import gpupool
from gpupool.adapters import torch_entry
from gpupool.errors import GpupoolError, NoDeviceError, import_extra, refuse_host_memory
from gpupool.public import public_dir

# OutOfMemoryError subclasses torch's: module __getattr__ makes it on first access.
__all__ = [  # noqa: F822
    "OutOfMemoryError", "allocator", "last_error", "memory_stats", "mempool", "use"]


def __dir__():
    """The public API and the module's dunder attributes, not the names it imports; the lazy
    OutOfMemoryError only once PyTorch is imported: listing it must not import PyTorch
    (help() and inspect read every name listed)."""
    imported = sys.modules.get("torch") is not None
    return public_dir(globals(), __all__, leave_out=() if imported else ("OutOfMemoryError",))

_MALLOC_GLOBAL = "gpupool_torch_malloc_raising"    # throws on failure (adapters/torch_entry.pyx)
_MALLOC_MEMPOOL = "gpupool_torch_malloc"           # NULL on failure
_FREE = "gpupool_torch_free"

_allocators = {}        # malloc name -> CUDAPluggableAllocator; PyTorch needs it kept alive
_installed = None       # what use() made PyTorch's allocator: "gpupool" or "pluggable"
_observing = False      # the out-of-memory observer is attached
_sharing = False        # the tensor reducer is registered with multiprocessing

_TOO_LATE = (
    "gpupool.torch.use() must run before PyTorch's first CUDA allocation, but PyTorch has "
    "already initialized CUDA and its own caching allocator, which cannot be replaced "
    "afterwards. Call gpupool.torch.use() at the start of the program, right after "
    "`import torch` and before any tensor is made on the GPU (torch.cuda.is_initialized() "
    "must be False), or route part of the program to gpupool with "
    "`with torch.cuda.use_mem_pool(gpupool.torch.mempool()):`.")

_FALLBACK = (
    "gpupool.torch.use(): gpupool's allocator for PyTorch is not available: {reason}. PyTorch "
    "allocates from gpupool through its pluggable allocator instead, which offers malloc and "
    "free only: torch.cuda.memory_stats() and memory_allocated() raise, CUDA graphs "
    "(torch.cuda.graph, torch.compile(mode='reduce-overhead')) and "
    "torch.backends.cudnn.benchmark fail, Tensor.record_stream is ignored. Set "
    "GPUPOOL_TORCH_ALLOCATOR=pluggable to choose that route without this warning.")


def __getattr__(name):
    if name == "OutOfMemoryError":
        return _oom_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _oom_type():
    """The out-of-memory error both PyTorch and gpupool users catch (made on first use);
    without PyTorch, the ImportError naming gpupool's extra, as use() and mempool() raise."""
    torch = import_extra("torch", "torch", "PyTorch with CUDA", "torch")

    class OutOfMemoryError(torch.OutOfMemoryError, gpupool.OutOfMemoryError):
        """gpupool ran out of memory serving PyTorch; the message has gpupool's numbers."""

    OutOfMemoryError.__module__ = __name__
    OutOfMemoryError.__qualname__ = "OutOfMemoryError"
    torch_entry._set_torch_oom_type(OutOfMemoryError)
    return OutOfMemoryError


def _cuda_torch():
    """``torch``, once it has CUDA and sees a device; NoDeviceError otherwise."""
    torch = import_extra("torch", "torch", "PyTorch with CUDA", "torch")

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
    refuse_host_memory(pool, "PyTorch's CUDA tensors")


def _allocator(malloc):
    """The ``CUDAPluggableAllocator`` over the extension's ``malloc`` and free (cached)."""
    allocator = _allocators.get(malloc)
    if allocator is None:
        import torch

        allocator = _allocators[malloc] = torch.cuda.memory.CUDAPluggableAllocator(
            torch_entry.__file__, malloc, _FREE)
    return allocator


def use(pool=None):
    """Make gpupool PyTorch's CUDA allocator for the whole process.

    Every CUDA tensor made afterwards is a block of ``gpupool.get_pool(device)``, allocated on
    PyTorch's current stream and freed when the tensor dies. The allocator is gpupool's C++
    allocator, built on the first call against the installed PyTorch (then cached); where it
    cannot be, a warning says why and PyTorch's pluggable allocator serves instead (see the
    module's documentation and :func:`allocator`). Calling it again only changes the pool.

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
        ``pool`` is not a ``gpupool.Pool``, or is on a simulated device;
        ``GPUPOOL_TORCH_ALLOCATOR`` is neither ``gpupool`` nor ``pluggable``.

    Warns
    -----
    RuntimeWarning
        gpupool's allocator cannot be built or loaded here (the message says why and what to
        do): the pluggable allocator serves instead.

    Notes
    -----
    ``GPUPOOL_TORCH_ALLOCATOR=pluggable`` chooses the pluggable allocator without a warning.
    The compiled allocator is kept in ``$GPUPOOL_CACHE_DIR`` (default ``~/.cache/gpupool``);
    ``$CXX`` names the compiler.
    """
    global _installed
    if pool is not None:
        _check_pool(pool)
    torch = _cuda_torch()
    if _installed is None:
        if torch.cuda.is_initialized():
            raise GpupoolError(_TOO_LATE)
        _oom_type()
        _installed = _install(torch)
    _share_through_gpupool(torch)
    if pool is not None:
        gpupool.set_pool(pool)


def _install(torch):
    """Make gpupool's C++ allocator PyTorch's, else the pluggable one; returns which."""
    choice = os.environ.get("GPUPOOL_TORCH_ALLOCATOR") or "gpupool"
    if choice not in ("gpupool", "pluggable"):
        raise ValueError(f"GPUPOOL_TORCH_ALLOCATOR={choice!r}: must be 'gpupool' (gpupool's "
                         f"allocator) or 'pluggable' (PyTorch's pluggable allocator)")
    if choice == "gpupool":
        from gpupool.adapters import torch_allocator

        try:
            torch_allocator.install(torch)
            return "gpupool"
        except torch_allocator.Unavailable as exc:
            reason = str(exc)
        except RuntimeError as exc:
            if "initialized" in str(exc):       # "Can't swap an already initialized allocator"
                raise GpupoolError(_TOO_LATE) from exc
            reason = f"PyTorch refused it ({exc})"
        warnings.warn(_FALLBACK.format(reason=reason), RuntimeWarning, stacklevel=3)
    try:
        torch.cuda.memory.change_current_allocator(_allocator(_MALLOC_GLOBAL))
    except RuntimeError as exc:       # "Can't swap an already initialized allocator"
        raise GpupoolError(_TOO_LATE) from exc
    return "pluggable"


def allocator():
    """Which allocator :func:`use` made PyTorch's: ``"gpupool"`` (gpupool's C++ allocator),
    ``"pluggable"`` (PyTorch's pluggable allocator over gpupool's C entry points: malloc and
    free only), or None before :func:`use`."""
    return _installed


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
    if _installed is not None:
        raise GpupoolError(
            "gpupool.torch.use() already routes every PyTorch allocation to gpupool; "
            "mempool() is for programs that keep PyTorch's own allocator")
    if pool is not None:
        gpupool.set_pool(pool)
    _observe_oom(torch)
    _share_through_gpupool(torch)
    return torch.cuda.MemPool(_allocator(_MALLOC_MEMPOOL).allocator())


# Sharing tensors between processes ---------------------------------------------------------

def _share_through_gpupool(torch):
    """Register :func:`_reduce_tensor` for every tensor class with multiprocessing's
    ForkingPickler (after ``torch.multiprocessing``'s own registrations, which ``import
    torch`` makes); under ``use()`` also make PyTorch's rebuilding of its own CUDA handles
    say what to do instead of failing in the pluggable allocator."""
    global _sharing
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    if not _sharing:
        for cls in {torch.Tensor, torch.nn.Parameter, *torch._tensor_classes}:
            ForkingPickler.register(cls, _reduce_tensor)
        _sharing = True
    if _installed and not getattr(reductions.rebuild_cuda_tensor, "_gpupool", False):
        reductions.rebuild_cuda_tensor = _refusing_rebuild(reductions.rebuild_cuda_tensor)


def _reduce_tensor(tensor):
    """multiprocessing's reduction of a tensor: a CUDA tensor whose storage is a gpupool
    block's memory travels as a gpupool IPC handle; any other goes through PyTorch's."""
    import torch
    from torch.multiprocessing import reductions

    from gpupool.ipc import export, mapping

    if (tensor.device.type != "cuda" or tensor.is_nested or tensor.layout != torch.strided
            or (tensor.requires_grad and not tensor.is_leaf)):
        return reductions.reduce_tensor(tensor)     # PyTorch's path (and its refusals)
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if not nbytes:
        return reductions.reduce_tensor(tensor)     # no memory: no handle either
    if mapping.is_imported(ptr):
        raise gpupool.IpcError(
            "this CUDA tensor was received from another process through gpupool: it cannot be "
            "sent on (as in PyTorch); clone it first (tensor.clone())", "received")
    pool = gpupool._pools.get(tensor.device.index)
    if pool is None or not export.owns(pool, ptr, nbytes):
        if _installed:
            raise gpupool.IpcError(
                f"this CUDA tensor's memory ({nbytes} B at {ptr:#x}) is not a block of "
                f"gpupool's pool of device {tensor.device.index}, though gpupool.torch.use() "
                f"routes every PyTorch allocation there: it cannot be shared",
                "foreign_memory")
        return reductions.reduce_tensor(tensor)
    torch.utils.hooks.warn_if_has_hooks(tensor)
    ref = reductions.StorageWeakRef(storage)
    handle = export.export_range(pool, ptr, nbytes,
                                 torch.cuda.current_stream(tensor.device).cuda_stream,
                                 lambda: not ref.expired())
    return _rebuild_tensor, (handle, type(tensor), tensor.dtype, tuple(tensor.size()),
                             tuple(tensor.stride()), tensor.storage_offset(),
                             tensor.requires_grad)


def _rebuild_tensor(handle, cls, dtype, size, stride, offset, requires_grad):
    """The receiving side of :func:`_reduce_tensor`: the tensor over the opened memory, on
    PyTorch's current stream of its device (which waits for the sender's work)."""
    import torch

    from gpupool.ipc import mapping

    pool = mapping.importer_pool(handle, None)
    stream = torch.cuda.current_stream(pool.device)
    buf = gpupool.open_ipc(handle, stream=stream.cuda_stream, pool=pool)
    flat = torch.from_dlpack(buf)                   # uint8, the storage's bytes
    tensor = flat.view(dtype).as_strided(size, stride, offset)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad = requires_grad
    return tensor


def _refusing_rebuild(rebuild):
    """PyTorch's ``rebuild_cuda_tensor``, whose failure under ``use()`` (neither gpupool's
    allocator nor the pluggable one opens CUDA IPC handles: getIpcDevPtr) becomes an error that
    says what to do."""

    @functools.wraps(rebuild)
    def rebuild_cuda_tensor(*args, **kwargs):
        try:
            return rebuild(*args, **kwargs)
        except RuntimeError as exc:
            if "getIpcDevPtr" not in str(exc):
                raise
            raise gpupool.IpcError(
                "this process allocates CUDA memory through gpupool.torch.use(), whose "
                "allocator cannot open the CUDA IPC handle of a tensor "
                "that another process shared from PyTorch's own allocator. Make the sender "
                "allocate through gpupool (gpupool.torch.use() or mempool() there: its "
                "tensors then travel as gpupool IPC handles), or use mempool() here instead "
                "of use()", "open_failed") from exc

    rebuild_cuda_tensor._gpupool = True
    return rebuild_cuda_tensor


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
    failure = torch_entry._take_torch_failure(device)
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
    return torch_entry._torch_last_failure()
