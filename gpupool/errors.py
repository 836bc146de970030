"""gpupool's exceptions.

Every error gpupool raises derives from :class:`GpupoolError`. Driver failures carry the
``CUresult`` code and its name, as ``cuGetErrorName`` gives it.
"""

__all__ = [
    "FORK_MESSAGE",
    "CudaError",
    "GpupoolError",
    "InvalidBufferError",
    "IpcError",
    "NoDeviceError",
    "OutOfMemoryError",
    "SleepingMemoryError",
]

#: The message of the GpupoolError that every call raises in a child of fork() whose parent
#: had used gpupool or CUDA.
FORK_MESSAGE = (
    "gpupool cannot be used in a process made by fork() after its parent used gpupool or "
    "CUDA: CUDA state (the driver's context, pools, their memory) does not cross fork(), so "
    "the pools, buffers and regions inherited here refuse every call and no new pool can be "
    "made. Start worker processes with the 'spawn' or 'forkserver' start method "
    "(multiprocessing.get_context('spawn').Pool(), multiprocessing.set_start_method("
    "'forkserver'), ProcessPoolExecutor(mp_context=multiprocessing.get_context('spawn'))), or "
    "fork before the parent's first use of gpupool")

#: The message of the GpupoolError raised by a call into a pool from inside its own upstream
#: call (a Python upstream's code, a collection there), whose thread holds the pool's lock.
REENTRANT_MESSAGE = "the pool was used from inside its own upstream call"


def did_you_mean(name, accepted):
    """``"; did you mean 'x'?"``, naming the choice among ``accepted`` that the misspelt
    ``name`` meant, as Python writes it (``'invalidate'``, ``None``): the one whose ``str`` is
    ``name`` but for case (``"INVALIDATE"``, ``"None"``), else the closest, case aside
    (``difflib.get_close_matches``); ``""`` when none is near or ``name`` is not a str: the
    end of the message of an unknown keyword, option or choice."""
    import difflib

    if not isinstance(name, str):
        return ""
    folded = {}
    for choice in accepted:
        folded.setdefault(str(choice).casefold(), choice)
    key = name.casefold()
    close = [key] if key in folded else difflib.get_close_matches(key, list(folded), n=1)
    return f"; did you mean {folded[close[0]]!r}?" if close else ""


def unexpected_keyword(owner, name, hint=""):
    """The TypeError of a keyword argument that class ``owner`` does not take, worded as
    Python's own (which, for a cdef class, names its ``__cinit__``), with ``hint`` or else
    the closest of its keywords (``inspect.signature``, from its docstring) when one is near:
    ``Pool() got an unexpected keyword argument 'hardlimit'; did you mean 'hard_limit'?``"""
    import inspect

    if not hint:
        try:
            accepted = inspect.signature(owner).parameters
        except (TypeError, ValueError):         # (a subclass without one)
            accepted = ()
        hint = did_you_mean(name, accepted)
    return TypeError(f"{owner.__name__}() got an unexpected keyword argument {name!r}{hint}")


def import_extra(module, extra, needs, package):
    """``importlib.import_module(module)``, or, where the framework it needs is missing, an
    ImportError that names gpupool's extra for it.

    Parameters
    ----------
    module : str
        The module to import (``"cupy"``, ``"gpupool.adapters.numba_manager"``...).
    extra : str
        gpupool's extra and adapter that need it (``"cupy"``, ``"torch"``, ``"numba"``...).
    needs : str
        What the adapter needs, in words (``"CuPy for CUDA 13"``).
    package : str
        The framework's own distribution (``"cupy-cuda13x"``), named after the extra.

    Raises
    ------
    ImportError
        ``gpupool.{extra} needs {needs}: pip install 'gpupool[{extra}]' (or pip install
        {package})``, from the ModuleNotFoundError of the framework itself (the extra's name is
        the framework's top-level module); a missing module of anything else propagates."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != extra:
            raise
        raise ImportError(f"gpupool.{extra} needs {needs}: pip install 'gpupool[{extra}]' "
                          f"(or pip install {package})") from exc


def not_picklable(what, instead):
    """The TypeError raised when pickling or copying ``what`` (a pool, a region), which holds
    this process's device memory; ``instead`` says what to do."""
    return TypeError(f"{what} cannot be pickled or copied: it holds device memory of this "
                     f"process, which no other process or copy can own; {instead}")


def refuse_host_memory(pool, serves):
    """Raise ValueError when ``pool``'s upstream holds host memory (the simulated device),
    which would reach the framework's kernels as device memory: an adapter's check of the
    pool it is given; ``serves`` names what the adapter would serve (``"CuPy's device
    allocations"``)."""
    if pool.upstream.host_accessible:
        raise ValueError(f"a pool on a simulated device holds host memory: it cannot serve "
                         f"{serves}; give it a pool on a GPU (gpupool.Pool(device=0)): a "
                         f"simulated pool's buffers are for NumPy and tests without a GPU")


class GpupoolError(Exception):
    """Base class of every gpupool error."""


class CudaError(GpupoolError, RuntimeError):
    """A CUDA driver call failed.

    Attributes
    ----------
    code : int
        The ``CUresult`` value the driver returned.
    name : str
        Its name (``cuGetErrorName``), for example ``"CUDA_ERROR_INVALID_VALUE"``.
    message : str
        The driver's description (``cuGetErrorString``) and the call that failed.
    """

    def __init__(self, code, name, message):
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        self.message = message

    def __reduce__(self):
        return type(self), (self.code, self.name, self.message)


class OutOfMemoryError(GpupoolError, MemoryError):
    """The upstream could not provide memory, even after trimming caches and running callbacks.

    ``OutOfMemoryError(message, *, requested_bytes=None, in_use_bytes=None, ...)``: the pool
    gives every number it knows; made from a message alone (as ``gpupool.torch`` makes its
    subclass), the numbers are None.

    Attributes
    ----------
    requested_bytes : int or None
        Bytes of the allocation that failed.
    in_use_bytes, reserved_bytes, cached_bytes : int or None
        The pool's bytes in live blocks, reserved from the upstream, and cached (free, held by
        the pool and its regions) when it failed (``Pool.stats()``'s fields).
    limit_bytes : int or None
        The pool's hard limit; None when it has none.
    device_free_bytes, device_total_bytes : int or None
        The device's free and total bytes when known without a CUDA driver call: the total
        as the pool learnt it at creation (driver upstreams) or from ``Pool.mem_info()``;
        both from NVML on a real device where ``pynvml`` (nvidia-ml-py) is installed; None
        otherwise (the pool does not call the driver while raising: the call could fail or
        block where memory just ran out; ``Pool.mem_info()`` asks it).
    largest_free_bytes : int or None
        Bytes of the largest free block any request may take (the pool's, idle regions',
        threads' held blocks) after the pool gave back what it could.
    unusable_cached_bytes : int or None
        Cached bytes that cannot serve this request: ``cached_bytes`` minus the bytes of free
        blocks at least as large as the request (fragmentation: free blocks too small, kept
        because live blocks share their segments).
    by_owner : dict or None
        Bytes in use by owner: ``"pool"`` (blocks outside any region, escaped ones included)
        and ``"region <id> '<name>'"`` / ``"private pool <id>"`` for each region or private
        pool (a graph's) with live blocks. Adapters (CuPy, Numba, PyTorch) allocate from the
        pool or a region and are counted there: the pool does not record which one asked.
    by_stream : dict or None
        Bytes in use by the stream the block was last used on: ``{stream handle: bytes}``
        (0: the legacy default stream, 2: the per-thread one).
    device_used_by_others_bytes : int or None
        Bytes of the device used by other processes (NVML's compute processes other than
        this one); None without ``pynvml``, without a device (the simulated one), or when
        NVML fails or cannot match the device.
    """

    FIELDS = ("requested_bytes", "in_use_bytes", "reserved_bytes", "cached_bytes",
              "limit_bytes", "device_free_bytes", "device_total_bytes", "largest_free_bytes",
              "unusable_cached_bytes", "by_owner", "by_stream", "device_used_by_others_bytes")
    requested_bytes = in_use_bytes = reserved_bytes = cached_bytes = None
    limit_bytes = device_free_bytes = device_total_bytes = None
    largest_free_bytes = unusable_cached_bytes = by_owner = by_stream = None
    device_used_by_others_bytes = None

    def __init__(self, message, **numbers):
        unknown = set(numbers) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"OutOfMemoryError takes the keywords {', '.join(self.FIELDS)}; "
                            f"not {', '.join(sorted(unknown))}")
        super().__init__(message)
        for name, value in numbers.items():
            setattr(self, name, value)


class InvalidBufferError(GpupoolError, ValueError):
    """A buffer was used after ``close()``, or after its region invalidated it."""


class SleepingMemoryError(GpupoolError, RuntimeError):
    """Memory of a tag that sleeps (``Pool.sleep``) was used or requested: a buffer's
    contents read, written or exported, or an allocation under ``gpupool.tag`` of that tag.
    ``Pool.wake`` maps it again."""


class NoDeviceError(GpupoolError, RuntimeError):
    """There is no CUDA driver, no device, or no such device."""


class IpcError(GpupoolError, RuntimeError):
    """A buffer cannot be exported for CUDA IPC, or a handle cannot be opened.

    ``IpcError(message, reason)``: the message says what happened and what to do.

    Attributes
    ----------
    reason : str
        What went wrong, for programs that act on it: ``"malformed"`` (bytes that are not a
        gpupool IPC handle), ``"same_process"`` (opened in the process that made it),
        ``"wrong_device"`` (another GPU, or simulated memory on a GPU and the reverse),
        ``"released"`` (the exporter gave the buffer back, or the segment went back to the
        driver), ``"exporter_exited"``, ``"not_exportable"`` (the pool's upstream cannot
        export its memory), ``"foreign_memory"`` (the buffer wraps memory of another
        library), ``"received"`` (memory this process opened from another one),
        ``"no_descriptors"`` (a handle of virtual-memory pages whose file descriptors did
        not travel with it and could not be fetched), ``"open_failed"`` (the driver refused
        to open it).
    """

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        return type(self), (str(self), self.reason)
