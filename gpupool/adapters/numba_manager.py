"""The Numba External Memory Management plugin class; imports Numba.

Loaded by :mod:`gpupool.numba` when the class is first asked for, so that importing
``gpupool.numba`` does not import Numba. See that module for how to turn the plugin on.
"""

import contextlib
import threading
import weakref

from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv.driver import binding

from gpupool.adapters import numba_ipc
from gpupool.core import defaults

EMM_INTERFACE_VERSION = 1


def _device_ordinal(device):
    """The ordinal of a Numba context's device: a Numba ``Device`` (or a weak proxy of one)
    has ``.id``; a ``cuda.bindings.driver.CUdevice`` converts with ``int``."""
    ordinal = getattr(device, "id", None)
    if ordinal is not None:
        return ordinal
    if not hasattr(type(device), "__int__"):
        raise TypeError(f"a Numba context's device has no ordinal: {device!r} has no 'id' "
                        f"and is not a CUdevice")
    return int(device)


class GpupoolNumbaManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Numba's device memory from a gpupool pool (EMM plugin, interface version 1).

    Numba makes one instance per CUDA context, as ``GpupoolNumbaManager(context=ctx)``;
    turn it on with ``gpupool.numba.use()`` or ``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba``.
    Pinned and mapped host memory stay Numba's own (``HostOnlyCUDAMemoryManager``).

    Parameters
    ----------
    context : numba.cuda.cudadrv.driver.Context or None
        The context served; None for the throwaway instance ``numba.cuda.set_memory_manager``
        makes to read ``interface_version``. Its ``device`` is a Numba ``Device`` (ordinal
        ``.id``) or, for a context made over a primary context that another library created
        (``driver.Context(CUdevice(n), handle)``), a ``cuda.bindings.driver.CUdevice``
        (ordinal ``int(device)``).
    pool : gpupool.Pool, optional
        The pool to draw from; default: ``gpupool.get_pool(d)`` at each allocation, ``d``
        the context's device (so ``gpupool.set_pool`` applies).

    Raises
    ------
    ValueError
        ``pool`` belongs to another device than the context.
    TypeError
        The context's device is neither shape above.
    """

    def __init__(self, *args, pool=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._device = None if self.context is None else _device_ordinal(self.context.device)
        if pool is not None and self._device is not None and pool.device != self._device:
            raise ValueError(f"gpupool pool of device {pool.device} given for a Numba context "
                             f"of device {self._device}")
        self._fixed_pool = pool
        # Reentrant: a garbage collection inside a locked section can run a finalizer.
        self._lock = threading.RLock()
        self._defer_depth = 0
        self._deferred = []

    @property
    def interface_version(self):
        """The EMM interface version implemented: 1."""
        return EMM_INTERFACE_VERSION

    def pool(self):
        """The gpupool pool this context's allocations come from now."""
        if self._fixed_pool is not None:
            return self._fixed_pool
        return defaults.get_pool(self._device)

    def initialize(self):
        """Make the device's pool now (``gpupool.get_pool``), so that a missing driver or
        device shows when Numba sets the context up rather than at its first allocation."""
        self.pool()

    def memalloc(self, size):
        """Allocate ``size`` bytes of device memory for Numba.

        Parameters
        ----------
        size : int
            Bytes, >= 0; 0 gives an empty pointer (address 0).

        Returns
        -------
        numba.cuda.MemoryPointer
            Over a :class:`gpupool.DeviceBuffer` allocated on the legacy default stream
            (handle 0) by ``Pool.allocate``, so the current region, if any, caches it. The
            buffer is closed (its block goes back to the pool or region) when Numba frees the
            pointer: when the last array over it dies, or at the end of ``defer_cleanup``.

        Raises
        ------
        gpupool.OutOfMemoryError, gpupool.CudaError
            As ``Pool.allocate``.
        """
        buf = self.pool().allocate(size)
        context = weakref.proxy(self.context)
        if not size:
            # Like Numba's own empty arrays: no finalizer, as Numba's view() of one requires.
            return MemoryPointer(context, binding.CUdeviceptr(0), 0)
        return MemoryPointer(context, binding.CUdeviceptr(buf.ptr), size,
                             finalizer=self._finalizer(buf))

    def _finalizer(self, buf):
        # Holds the buffer, not the pointer, so the pointer can die and run it.
        def free():
            with self._lock:
                if self._defer_depth:
                    self._deferred.append(buf)
                    return
            buf.close()

        return free

    @contextlib.contextmanager
    def defer_cleanup(self):
        """While active, memory Numba frees is held and given back at the end of the
        outermost ``defer_cleanup`` (``numba.cuda.defer_cleanup()``): use it while kernels
        on streams other than the legacy default one may still read freed arrays."""
        with super().defer_cleanup():
            with self._lock:
                self._defer_depth += 1
            try:
                yield
            finally:
                with self._lock:
                    self._defer_depth -= 1
                    ready = [] if self._defer_depth else self._deferred
                    if ready:
                        self._deferred = []
                for buf in ready:
                    buf.close()

    def reset(self):
        """Numba's context reset (``numba.cuda.close()``): free Numba's host memory and give
        the pool's cached blocks back to the driver (``Pool.trim``). Arrays still alive keep
        their memory; note that ``numba.cuda.close()`` then resets the device's primary
        context, which frees every library's memory on it, gpupool's too."""
        super().reset()
        self.pool().trim()

    def get_memory_info(self):
        """``MemoryInfo(free, total)``: the device's free and total bytes from the driver
        (``cuMemGetInfo``). Blocks cached by gpupool count as used; see
        ``self.pool().stats()``."""
        free, total = self.pool().mem_info()
        return MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory):
        """An IPC handle of ``memory`` for another process.

        On upstream "driver" it is Numba's ``IpcHandle`` of ``cuIpcGetMemHandle``: it names
        the whole driver allocation holding ``memory`` (found with ``cuMemGetAddressRange``:
        for blocks up to 256 KiB, a 2 MiB shared segment that holds other blocks too) and
        carries ``memory``'s offset in it, so the importer sees the right bytes. On upstream
        "vmm" (expandable segments, which ``cuIpcGetMemHandle`` cannot name) it is a
        :class:`gpupool.adapters.numba_ipc.GpupoolIpcHandle`, a subclass of Numba's that
        carries gpupool's export of exactly ``memory``'s bytes (a POSIX file descriptor per
        page) and opens it through ``gpupool.open_ipc``; it pickles with ``pickle`` and
        through ``multiprocessing``, as Numba's does.

        Stream semantics: on "vmm" the importer's legacy default stream waits for the work
        queued on this process's legacy default stream before this call (an IPC event);
        on "driver", as in Numba, nothing orders the importer after the exporter's work.

        Raises
        ------
        ValueError
            ``memory`` is empty (address 0): it has no allocation to share.
        gpupool.IpcError
            On "vmm": ``memory`` is not memory of this context's pool (reason
            "foreign_memory"), or the pool cannot export (as ``DeviceBuffer.ipc_handle``).
        """
        if not memory.device_pointer_value:
            raise ValueError("an empty Numba allocation (size 0) has no IPC handle")
        pool = self.pool()
        if pool.upstream.expandable:
            identity = getattr(self.context.device, "get_device_identity", None)
            return numba_ipc.export(pool, memory, identity() if identity else None)
        return super().get_ipc_handle(memory)
