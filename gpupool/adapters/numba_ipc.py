"""Numba's IPC handle for memory of expandable segments (upstream "vmm"); imports Numba.

``cuIpcGetMemHandle`` cannot name memory made with ``cuMemCreate``, so on a "vmm" pool the
Numba plugin (``GpupoolNumbaManager.get_ipc_handle``) returns a :class:`GpupoolIpcHandle`: a
``numba.cuda.cudadrv.driver.IpcHandle`` that carries gpupool's own export of the memory (a
``gpupool.IpcHandle``: one POSIX file descriptor per page, see ``gpupool.ipc``) and opens it in
the importing process through ``gpupool.open_ipc``. Numba's protocol is kept: ``open`` /
``open_array`` / ``open_staged`` / ``close``, "IpcHandle is already opened", pickling by
``pickle`` and by ``multiprocessing`` (the page descriptors travel as ``gpupool.IpcHandle``'s
do), ``.handle.reserved`` as the handle's bytes. See Note [Numba IPC on expandable segments]
in docs/design.md.
"""

import weakref

from numba.cuda.cudadrv.driver import Device, IpcHandle, MemoryPointer, binding, device_to_device

from gpupool.buffer.device_buffer import wrap
from gpupool.errors import IpcError
from gpupool.ipc import export as export_module
from gpupool.ipc import open_ipc
from gpupool.ipc.handle import IpcHandle as PoolIpcHandle


class _HandleBytes:
    """What Numba reads of a handle's ``handle``: ``reserved``, the handle's bytes (of a
    ``gpupool.IpcHandle``, not the 64 of a ``CUipcMemHandle``)."""

    __slots__ = ("reserved",)

    def __init__(self, reserved):
        self.reserved = reserved


def export(pool, memory, source_info):
    """The :class:`GpupoolIpcHandle` of Numba's ``memory`` (a ``MemoryPointer`` or a view of
    one, of ``pool``'s memory); the event the importer waits for is recorded on the legacy
    default stream.

    Raises
    ------
    gpupool.IpcError
        ``memory`` lies in no live block of ``pool`` (reason "foreign_memory": it was freed, or
        another allocator's), or as ``DeviceBuffer.ipc_handle``.
    """
    address, size = memory.device_pointer_value, memory.size
    if not export_module.owns(pool, address, size):
        raise IpcError(f"Numba memory of {size} B at {address:#x} is no live allocation of "
                       f"{pool!r} (freed, or made by another allocator): only live gpupool "
                       f"memory can be shared", "foreign_memory")
    wrapper = wrap(pool, address, size, None, None, memory)
    return GpupoolIpcHandle(memory, wrapper.ipc_handle(), size, source_info)


class GpupoolIpcHandle(IpcHandle):
    """Numba's IPC handle of gpupool memory of expandable segments (upstream "vmm").

    Parameters
    ----------
    base : numba.cuda.MemoryPointer or None
        The exported memory, kept alive by the handle; None in the importing process.
    pool_handle : gpupool.IpcHandle
        gpupool's export of exactly the ``size`` bytes Numba shares (its offset included).
    size : int
        Bytes shared.
    source_info : dict or None
        The exporting device's identity (``Device.get_device_identity()``).

    Notes
    -----
    ``offset`` is 0: ``pool_handle`` holds the memory's place in its pages. The importer's
    legacy default stream waits (on the device, ``cuStreamWaitEvent``) for the exporter's work
    queued on the legacy default stream before ``get_ipc_handle``; work of other streams must
    be synchronized by the exporter first. The exporter's rule of ``gpupool.ipc`` applies: keep
    the array alive and unwritten until every importer has closed its handle.
    """

    def __init__(self, base, pool_handle, size, source_info=None):
        if not isinstance(pool_handle, PoolIpcHandle):
            raise TypeError(f"GpupoolIpcHandle carries a gpupool.IpcHandle, not "
                            f"{type(pool_handle).__name__}")
        if size != pool_handle.nbytes:
            raise ValueError(f"a handle of {pool_handle.nbytes} B cannot share {size} B")
        super().__init__(base, _HandleBytes(pool_handle.to_bytes()), size, source_info,
                         offset=0)
        self.pool_handle = pool_handle

    def __reduce__(self):
        # The gpupool handle pickles itself: bytes for pickle (pages fetched with
        # pidfd_getfd), descriptors passed for multiprocessing's pickler.
        return _rebuild, (self.pool_handle, self.size, self.source_info)

    def open(self, context):
        """Open the memory in ``context`` (Numba's ``IpcHandle.open``): mapped here when
        ``context`` is on the exporting device (or the handle names none), else copied through
        ``open_staged``. Returns a ``MemoryPointer`` of ``size`` bytes.

        Raises
        ------
        ValueError
            The handle is already open, or this is the exporting process.
        gpupool.IpcError
            As ``gpupool.open_ipc`` (the buffer was given back, the exporter exited, ...).
        """
        same = self.source_info is None or \
            self.source_info == context.device.get_device_identity()
        return self.open_direct(context) if same else self.open_staged(context)

    def open_direct(self, context):
        """Map the memory into this process (``gpupool.open_ipc`` on the legacy default
        stream) and return a ``MemoryPointer`` over it; ``close()`` unmaps it. Raises as
        ``open``."""
        return self._open_with(_DirectImpl(self), context)

    def open_staged(self, context):
        """Map the memory on the exporting device, copy it into a new allocation of
        ``context`` (``context.memalloc``, ``device_to_device``) and unmap it; returns the new
        allocation, which ``close()`` leaves alone. Raises as ``open``, and
        ``RuntimeError`` for a handle without ``source_info``."""
        self._sentry_source_info()
        return self._open_with(_StagedImpl(self), context)

    def _open_with(self, impl, context):
        if self._impl is not None:
            raise ValueError("IpcHandle is already opened")
        pointer = impl.open(context)
        self._impl = impl
        return pointer


def _rebuild(pool_handle, size, source_info):
    return GpupoolIpcHandle(None, pool_handle, size, source_info)


class _DirectImpl:
    """An open mapping of a GpupoolIpcHandle (Numba's ``_CudaIpcImpl``)."""

    def __init__(self, parent):
        self.parent = parent
        self.buffer = None

    def open(self, context):
        if self.parent.base is not None:
            raise ValueError("opening IpcHandle from original process")
        self.buffer = open_ipc(self.parent.pool_handle)
        return MemoryPointer(weakref.proxy(context), binding.CUdeviceptr(self.buffer.ptr),
                             self.parent.size)

    def close(self):
        # Waits for the device's queued work, then unmaps (gpupool.open_ipc).
        buffer, self.buffer = self.buffer, None
        buffer.close()


class _StagedImpl:
    """A copy of a GpupoolIpcHandle's memory in another device's context (Numba's
    ``_StagedIpcImpl``): the mapping is made and closed on the exporting device."""

    def __init__(self, parent):
        self.parent = parent

    def open(self, context):
        from numba import cuda

        source = int(Device.from_identity(self.parent.source_info).id)
        direct = _DirectImpl(self.parent)
        with cuda.gpus[source]:
            pointer = direct.open(cuda.devices.get_context())
        try:
            copy = context.memalloc(self.parent.size)
            device_to_device(copy, pointer, self.parent.size)
        finally:
            with cuda.gpus[source]:
                direct.close()
        return copy

    def close(self):
        """Nothing: the mapping closed at the open; the copy is the caller's."""
