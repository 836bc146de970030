"""Numba adapter: Numba's device arrays allocated from gpupool (an EMM plugin).

::

    import gpupool.numba
    gpupool.numba.use()          # before Numba's first CUDA call (array, kernel, context)

    # or, for a whole program, with no change to its code:
    #   NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba python program.py

Every ``numba.cuda.device_array`` (and every other device allocation Numba makes) is then a
:class:`gpupool.DeviceBuffer` from ``gpupool.get_pool(device)``, allocated on the legacy
default stream; regions apply to it as to any other allocation. Pinned and mapped host
memory stay Numba's. The plugin class is :class:`GpupoolNumbaManager`.

CUDA IPC (``array.get_ipc_handle()``, ``context.get_ipc_handle(memory)``): on upstream
"driver" Numba's own handle (``cuIpcGetMemHandle``); on upstream "vmm" a subclass of Numba's
``IpcHandle`` carrying gpupool's export (``gpupool.ipc``), opened, pickled and closed as
Numba's is. A handle sent as its ``handle.reserved`` bytes alone (``cuda.open_ipc_array``)
opens on "driver" only.

Numba is imported when the class is first asked for (``gpupool.numba.GpupoolNumbaManager``,
``use()``, or Numba's own lookup of ``_numba_memory_manager``), not when this module is.
"""

from typing import TYPE_CHECKING

from gpupool.errors import import_extra
from gpupool.public import public_dir

if TYPE_CHECKING:                    # at run time the class comes from __getattr__, lazily
    pass

# GpupoolNumbaManager is left out of __all__: naming it imports Numba (help() and
# `import *` must work without Numba).
__all__ = ["use"]

_LAZY = ("GpupoolNumbaManager", "_numba_memory_manager")


def use():
    """Make Numba allocate device memory from gpupool (``numba.cuda.set_memory_manager``).

    Numba picks a context's memory manager when it creates the context, so call this before
    Numba's first CUDA call; ``NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba`` does the same from
    the environment. Calling it again is harmless.

    Raises
    ------
    ImportError
        numba-cuda is not installed.
    RuntimeError
        Numba already created a CUDA context with another memory manager.
    """
    manager = _manager_class()
    from numba import cuda
    from numba.cuda.cudadrv.driver import driver

    for device in list(driver.devices.values()):
        context = device.primary_context
        if context is not None and not isinstance(context.memory_manager, manager):
            raise RuntimeError(
                f"Numba already created its CUDA context on device {device.id} with "
                f"{type(context.memory_manager).__name__}; call gpupool.numba.use() before "
                f"Numba's first CUDA call, or set NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba")
    cuda.set_memory_manager(manager)


def __getattr__(name):
    # Numba reads ``_numba_memory_manager`` with getattr after importing this module.
    if name in _LAZY:
        return _manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    """The public API and the module's dunder attributes, not the names it imports; the lazy
    names are left out: listing them must not import Numba (help(), inspect)."""
    return public_dir(globals(), __all__)


def _manager_class():
    return import_extra("gpupool.adapters.numba_manager", "numba", "Numba's CUDA target",
                        "numba-cuda").GpupoolNumbaManager
